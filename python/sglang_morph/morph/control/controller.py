"""MorphController: from pressure signals and the current per-layer bits to one typed action.

The controller is a pure decision function with a little memory (streak counters, the time of
its last action). It never applies anything: the caller (an executor on the scheduler thread)
applies the returned ``SwapLayers`` between batches and passes the new per-layer bits to the
next ``decide``. That keeps it drivable by a simulator and testable without SGLang.
"""

from __future__ import annotations

import collections
import dataclasses

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.morph.control.policy import ModePolicy
from sglang_morph.morph.control.signals import PressureSignals


@dataclasses.dataclass(frozen=True)
class SwapLayers:
    """Serve ``layers`` at ``bits`` from now on; ``bits == 16`` is a restore.

    Invariants (checked): ``layers`` is non-empty without duplicates and in the order the
    controller chose them (the order an executor should apply them in).
    """

    layers: tuple[int, ...]
    bits: int
    reason: str  # human-readable, names the signal values that triggered the action

    def __post_init__(self) -> None:
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(
                f"SwapLayers: layers must be non-empty and distinct, got {self.layers}")
        if not 1 <= self.bits <= FULL_PRECISION_BITS:
            raise ValueError(
                f"SwapLayers: bits must be in 1..{FULL_PRECISION_BITS}, got {self.bits}")

    @property
    def restore(self) -> bool:
        return self.bits == FULL_PRECISION_BITS


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """Memory price of a decoder layer at each bit-width, and what KV capacity it buys.

    Every layer costs the same (uniform decoder stacks such as Llama). Invariants (checked):
    16 bits is present, fewer bits never cost more bytes, all sizes are positive.
    """

    layer_bytes_by_bits: dict[int, int]
    kv_bytes_per_token: int
    page_size_tokens: int

    def __post_init__(self) -> None:
        by_bits = self.layer_bytes_by_bits
        if FULL_PRECISION_BITS not in by_bits:
            raise ValueError(f"LayerCosts: layer_bytes_by_bits lacks {FULL_PRECISION_BITS} bits")
        if any(b < 1 or n <= 0 for b, n in by_bits.items()):
            raise ValueError(f"LayerCosts: bit-widths and byte sizes must be positive: {by_bits}")
        ordered = [by_bits[b] for b in sorted(by_bits)]
        if ordered != sorted(ordered):
            raise ValueError(f"LayerCosts: fewer bits must not cost more bytes: {by_bits}")
        if self.kv_bytes_per_token <= 0 or self.page_size_tokens <= 0:
            raise ValueError("LayerCosts: kv_bytes_per_token and page_size_tokens must be > 0")

    def layer_bytes(self, bits: int) -> int:
        try:
            return self.layer_bytes_by_bits[bits]
        except KeyError:
            known = sorted(self.layer_bytes_by_bits)
            raise ValueError(f"LayerCosts: no size for {bits}-bit layers; known: {known}") from None

    def freed_tokens(self, from_bits: int, to_bits: int) -> int:
        """KV tokens one layer's move from ``from_bits`` to ``to_bits`` frees (> 0) or needs
        back (< 0), in whole pages.

        Rounding is always in the safe direction: capacity gained is rounded down (never promise
        pages whose bytes are not there), capacity given back is rounded up (the weights must
        get all their bytes back).
        """
        delta_bytes = self.layer_bytes(from_bits) - self.layer_bytes(to_bits)
        kv, page = self.kv_bytes_per_token, self.page_size_tokens
        if delta_bytes >= 0:
            return delta_bytes // kv // page * page
        needed_tokens = -(delta_bytes // kv)  # ceil(-delta_bytes / kv)
        return -(-(-needed_tokens // page) * page)  # minus ceil to a whole page


class MorphController:
    """Decides when to quantize which layers under pressure and when to restore them.

    Rules (every time is the snapshots' clock, i.e. wall time, whatever the sampling rate):
    - A step is *high* when ``kv_usage >= kv_usage_high``, or the oldest waiting request is
      short of KV (held + reserved + its need > capacity) and will have waited
      ``>= queue_delay_high_s`` before the running requests' finishes free enough KV for it
      (``head_wait_s + head_kv_wait_s()``), or a request was retracted since the last step. A
      queue that waits for compute is not helped by more KV, and quantizing for it would cost
      quality for nothing; a queue that KV will let in soon enough is left to it. Swapping needs
      ``persist_steps`` consecutive high steps; a retraction or a KV-short head past the delay
      threshold fills that window at once: neither is a noisy gauge, both are work delayed or
      thrown away (the delay threshold is the persistence, in time rather than in scheduler
      steps, which are seconds apart on a loaded CPU).
    - A step is *calm* when it is not high, ``kv_usage < kv_usage_high -
      kv_usage_quiet_margin`` and no waiting request is short of KV; *quiet* when it is calm
      and nothing waits at all. A restore needs the current step quiet, and
      ``restore_quiet_s`` of calm: since the later of the last transition (its own or one
      noted by ``note_transition``) and the last step that was not calm. A request waiting a
      step for compute does not restart the window (under light load one arrives every few
      steps, and the window would never end while requests trickle in).
    - Bursts after a lull: a step *needs the grown pool* when it is high or its load (held +
      reserved + waiting needs) is above ``kv_usage_high`` of the pool that every layer this
      controller may restore would leave. A *lull* is the time between two such steps when it
      is at least ``restore_quiet_s`` (long enough to restore in): the gap between two bursts,
      whether idle or with light traffic. After lulls a restore also needs the current calm
      spell to last ``RESTORE_HOLD_MARGIN`` x the longest of the last ``RECENT_LULLS`` lulls
      (at most ``restore_hold_max_s``): bursts that keep coming that far apart find the grown
      pool still there instead of waiting for it to grow again.
    - A restore is cut to the longest prefix of candidates whose predicted usage, held +
      reserved (what the running requests still claim for their remaining output) over
      ``kv_capacity - tokens_needed_back``, stays below ``kv_usage_low``: the pool must not
      shrink below what running requests will fill, or the restore is undone by the next
      swap (thrash).
    - After any action the high streak restarts and no action follows within ``cooldown_s``.
      That and the gap between the high, quiet and low thresholds prevent oscillation.
    - An action moves ``layers_per_step`` layers, or more (up to ``max_layers_per_step``) when
      requests wait and admitting them all (held + reserved + the waiting requests' needs)
      at a usage of at most ``kv_usage_high`` takes more layers to free.
    - Swaps walk ``swap_order`` (most expendable first) towards the first bit-width of
      ``bits_sequence`` (limited to ``available_bits``) that some layer is still above; restores
      walk it backwards, straight to 16 bits, since an intermediate 8-bit stop would double the
      swaps and quiet windows before full quality is back.
    - Layers outside ``swap_order`` or in ``pinned`` never move. At most
      ``max_quantized_layers`` layers (all layers counted, statically quantized ones included)
      are ever below 16 bits.

    ``swap_order`` is checked for duplicates and negatives here and against the layer count at
    every ``decide`` (the count is the length of ``layer_bits``, which must not change).
    """

    RECENT_LULLS = 4
    RESTORE_HOLD_MARGIN = 1.5  # gaps between bursts vary; one a bit longer is still covered

    def __init__(
        self,
        policy: ModePolicy,
        swap_order: tuple[int, ...],
        available_bits: tuple[int, ...],
        costs: LayerCosts,
        max_quantized_layers: int | None = None,
    ) -> None:
        swap_order = tuple(swap_order)
        if len(set(swap_order)) != len(swap_order) or any(i < 0 for i in swap_order):
            raise ValueError(f"MorphController: swap_order must be distinct layer indices, "
                             f"got {swap_order}")
        for b in available_bits:
            costs.layer_bytes(b)  # raises for a bit-width we cannot price
        if max_quantized_layers is not None and max_quantized_layers < 0:
            raise ValueError(f"MorphController: max_quantized_layers must be >= 0, "
                             f"got {max_quantized_layers}")
        self._swap_order = swap_order
        self._available_bits = frozenset(available_bits)
        self._costs = costs
        self._max_quantized_layers = max_quantized_layers
        self._policy = policy
        self._num_layers: int | None = None
        self._last_action_s: float | None = None
        self._pinned: frozenset[int] = frozenset()
        self._last_busy_s: float | None = None  # the last step that was not calm
        # The last step whose load needed more KV than the fully restored pool has.
        self._last_need_s: float | None = None
        self._lulls_s: collections.deque[float] = collections.deque(maxlen=self.RECENT_LULLS)
        self._high_steps = 0

    @property
    def policy(self) -> ModePolicy:
        return self._policy

    @property
    def restore_hold_s(self) -> float:
        """How long the current quiet spell must last before a restore: the quiet window, or
        the margin times the longest recent lull when that is longer (capped)."""
        p = self._policy
        longest = max(self._lulls_s, default=0.0) * self.RESTORE_HOLD_MARGIN
        return min(max(p.restore_quiet_s, longest), p.restore_hold_max_s)

    def set_policy(self, policy: ModePolicy) -> None:
        """Switch modes at runtime. The high streak restarts (it was judged by the old
        thresholds); the cooldown and the quiet window still count from what happened."""
        self._policy = policy
        self._high_steps = 0

    def note_transition(self, time_s: float) -> None:
        """A transition the controller did not decide (``POST /morph/swap``) happened at
        ``time_s`` (the clock of ``PressureSignals.time_s``): the cooldown and the quiet window
        start again from it, as after an action of its own."""
        self._after_action(time_s)

    def _after_action(self, time_s: float) -> None:
        self._last_action_s = time_s
        self._high_steps = 0

    def decide(self, signals: PressureSignals, layer_bits: tuple[int, ...],
               pinned: frozenset[int] = frozenset()) -> SwapLayers | None:
        """One action or None. Layers in ``pinned`` (placed by an operator) are never moved,
        neither down under pressure nor back up when quiet."""
        self._check_layer_bits(layer_bits)
        self._pinned = frozenset(pinned)
        p, s = self._policy, signals
        high_reasons = []
        expected_wait_s = s.head_wait_s + s.head_kv_wait_s()
        kv_queue = s.head_blocked_by_kv and expected_wait_s >= p.queue_delay_high_s
        if s.kv_usage >= p.kv_usage_high:
            high_reasons.append(f"kv_usage {s.kv_usage:.2f} >= {p.kv_usage_high:.2f}")
        if kv_queue:
            high_reasons.append(
                f"head short of KV would wait {expected_wait_s:.2f} s (waited "
                f"{s.head_wait_s:.2f} s) >= {p.queue_delay_high_s} s with "
                f"{s.num_waiting_reqs} waiting")
        if s.retractions_delta > 0:
            high_reasons.append(f"{s.retractions_delta} retraction(s)")
        quiet_threshold = p.kv_usage_high - p.kv_usage_quiet_margin
        # Calm: no pressure and none building (usage under the quiet threshold, no request
        # short of KV). A request that waits one step for compute is not pressure: under light
        # load one arrives every few steps, and counting it would never let a quiet window
        # finish while requests trickle in. The restore itself still needs an empty queue.
        calm = (not high_reasons and s.kv_usage < quiet_threshold
                and not s.head_blocked_by_kv)
        quiet = calm and s.num_waiting_reqs == 0

        if high_reasons:
            self._high_steps += 1
            if s.retractions_delta > 0 or kv_queue:
                self._high_steps = max(self._high_steps, p.persist_steps)
        else:
            self._high_steps = 0
        self._track_lulls(s, layer_bits, calm, bool(high_reasons))

        if self._last_action_s is not None and s.time_s - self._last_action_s < p.cooldown_s:
            return None
        action = None
        if self._high_steps >= p.persist_steps:
            action = self._swap_down(s, layer_bits, "; ".join(high_reasons))
        elif quiet and self._quiet_for_s(s) >= p.restore_quiet_s \
                and s.time_s - self._last_busy_s >= self.restore_hold_s:
            action = self._restore(s, layer_bits, quiet_threshold)
        if action is not None:
            self._after_action(s.time_s)
        return action

    def _quiet_for_s(self, s: PressureSignals) -> float:
        """Calm since the later of the last step that was not calm and the last transition."""
        start = self._last_busy_s
        if self._last_action_s is not None:
            start = max(start, self._last_action_s)
        return s.time_s - start

    def _track_lulls(self, s: PressureSignals, layer_bits: tuple[int, ...], calm: bool,
                     high: bool) -> None:
        if self._last_busy_s is None:  # the first step starts the quiet window
            self._last_busy_s = s.time_s
        if not calm:
            self._last_busy_s = s.time_s
        if high or self._needs_grown_pool(s, layer_bits):
            # A spell long enough to restore in, in which the load would have fit the fully
            # restored pool, ends here with load that needs the grown one: a lull between two
            # bursts. (No lull before the first burst: start-up idle says nothing of bursts.)
            if self._last_need_s is not None \
                    and s.time_s - self._last_need_s >= self._policy.restore_quiet_s:
                self._lulls_s.append(s.time_s - self._last_need_s)
            self._last_need_s = s.time_s

    def _needs_grown_pool(self, s: PressureSignals, layer_bits: tuple[int, ...]) -> bool:
        """The load would be high in the pool left after restoring every layer this controller
        may restore: held + reserved + waiting needs above ``kv_usage_high`` of it."""
        granted = sum(self._costs.freed_tokens(FULL_PRECISION_BITS, layer_bits[i])
                      for i in self._swap_order
                      if layer_bits[i] < FULL_PRECISION_BITS and i not in self._pinned)
        demand = s.kv_used_tokens + s.kv_reserved_tokens + s.waiting_need_tokens
        return demand > self._policy.kv_usage_high * (s.kv_capacity_tokens - granted)

    def _check_layer_bits(self, layer_bits: tuple[int, ...]) -> None:
        n = len(layer_bits)
        if self._num_layers is None:
            if self._swap_order and max(self._swap_order) >= n:
                raise ValueError(f"MorphController: swap_order names layer "
                                 f"{max(self._swap_order)} but the model has {n} layers")
            self._num_layers = n
        elif n != self._num_layers:
            raise ValueError(f"MorphController: layer_bits has {n} entries, "
                             f"expected {self._num_layers}")
        for i in self._swap_order:
            self._costs.layer_bytes(layer_bits[i])  # a layer we may move must have a known size

    def _swap_down(self, s: PressureSignals, layer_bits: tuple[int, ...],
                   why: str) -> SwapLayers | None:
        p = self._policy
        targets = [b for b in p.bits_sequence if b in self._available_bits]
        num_quantized = sum(b < FULL_PRECISION_BITS for b in layer_bits)
        # Room for the queue at the trigger's own usage level, so the swap that admits it does
        # not leave the pool at the threshold that triggers the next one.
        deficit = s.kv_deficit_tokens(p.kv_usage_high)
        limit = p.max_layers_per_step if deficit > 0 else p.layers_per_step
        for target in targets:
            quota = (self._max_quantized_layers - num_quantized
                     if self._max_quantized_layers is not None else len(layer_bits))
            picked, freed = [], 0
            for i in self._swap_order:
                if len(picked) == limit or (len(picked) >= p.layers_per_step
                                            and freed >= deficit):
                    break
                if layer_bits[i] <= target or i in self._pinned:
                    continue
                if layer_bits[i] == FULL_PRECISION_BITS:
                    if quota <= 0:
                        continue  # already-quantized layers may still go lower
                    quota -= 1
                picked.append(i)
                freed += self._costs.freed_tokens(layer_bits[i], target)
            if picked:
                short = f", waiting requests lack {deficit}" if deficit else ""
                return SwapLayers(tuple(picked), target,
                                  f"{why} for {self._high_steps} steps; "
                                  f"frees {freed} KV tokens{short}")
        return None  # every swappable layer is at the last target (or the cap is reached)

    def _restore(self, s: PressureSignals, layer_bits: tuple[int, ...],
                 quiet_threshold: float) -> SwapLayers | None:
        p = self._policy
        candidates = [i for i in reversed(self._swap_order)
                      if layer_bits[i] < FULL_PRECISION_BITS
                      and i not in self._pinned][: p.restore_layers_per_step]
        # What the running requests will fill: what they hold and what they still claim.
        claimed = s.kv_used_tokens + s.kv_reserved_tokens
        chosen, needed_tokens, predicted = [], 0, claimed / max(1, s.kv_capacity_tokens)
        for i in candidates:
            need = needed_tokens - self._costs.freed_tokens(layer_bits[i], FULL_PRECISION_BITS)
            capacity_after = s.kv_capacity_tokens - need
            if capacity_after <= 0 or claimed / capacity_after >= p.kv_usage_low:
                break  # a prefix only: restoring out of order would break last-in-first-out
            chosen.append(i)
            needed_tokens, predicted = need, claimed / capacity_after
        if not chosen:
            return None
        hold = self.restore_hold_s
        held = f", hold {hold:.1f} s after recent lulls" if hold > p.restore_quiet_s else ""
        return SwapLayers(
            tuple(chosen), FULL_PRECISION_BITS,
            f"quiet for {self._quiet_for_s(s):.1f} s{held} "
            f"(kv_usage {s.kv_usage:.2f} < {quiet_threshold:.2f}, no queue); "
            f"gives back {needed_tokens} KV tokens, predicted kv_usage (held + reserved) "
            f"{predicted:.2f} < {p.kv_usage_low:.2f}")
