"""Morph modes: the thresholds and pacing a ``MorphController`` decides with.

A mode is one frozen ``ModePolicy``; ``MODES`` is the registry the CLI edge resolves a name
against (``get_mode``). Modes differ in how readily they give up precision for KV capacity and
how eagerly they take it back.
"""

from __future__ import annotations

import dataclasses

from sglang_morph.config import FULL_PRECISION_BITS


@dataclasses.dataclass(frozen=True)
class ModePolicy:
    """Thresholds and pacing of one mode.

    Invariants (checked): ``0 <= kv_usage_low < kv_usage_high - kv_usage_quiet_margin`` and
    ``kv_usage_high <= 1``, so the "quiet" band and the restore target both lie strictly below
    the swap trigger (that gap is the hysteresis); step counts and layer counts >= 1; times
    >= 0; ``bits_sequence`` is non-empty, strictly decreasing and below full precision.
    """

    name: str
    # --- swapping down (pressure) ---
    kv_usage_high: float  # KV usage at/above which a step counts as high
    # A step is high when the oldest waiting request, short of KV, will have waited this long
    # (so far + until the running requests' finishes free enough KV) if nothing is done.
    queue_delay_high_s: float
    persist_steps: int  # consecutive high steps before acting: one spike is not a burst
    layers_per_step: int  # layers quantized per action
    # When requests wait for KV, one action may move up to this many layers: as many as cover
    # the waiting demand's deficit, so a burst is absorbed in one step rather than one step
    # per cooldown while its requests queue.
    max_layers_per_step: int
    # Target bit-widths in order: a later entry is used only once every swappable layer is at
    # or below the earlier one, so quality degrades gradually (8 everywhere before any 4).
    bits_sequence: tuple[int, ...]
    # --- restoring (no pressure) ---
    kv_usage_quiet_margin: float  # a step is quiet only below kv_usage_high - this margin
    # Restore only if the predicted usage after the restore (held + reserved for the running
    # requests' remaining output, over the smaller pool) stays below this.
    kv_usage_low: float
    # Quiet for this long, wall time, since the later of the last transition and the last
    # sample that was not quiet ...
    restore_quiet_s: float
    # ... and, when pressure came back after recent lulls, no pressure for as long as the
    # longest of those lulls (the next burst is likely that close), up to this cap.
    restore_hold_max_s: float
    restore_layers_per_step: int
    # --- both ---
    cooldown_s: float  # minimum time between two actions; a swap is not free, thrash is worse

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"ModePolicy {self.name!r}: {msg}")

        if not 0.0 < self.kv_usage_high <= 1.0:
            raise bad(f"kv_usage_high must be in (0, 1], got {self.kv_usage_high}")
        if not 0.0 <= self.kv_usage_quiet_margin < self.kv_usage_high:
            raise bad(f"kv_usage_quiet_margin must be in [0, kv_usage_high), "
                      f"got {self.kv_usage_quiet_margin}")
        if not 0.0 <= self.kv_usage_low < self.kv_usage_high - self.kv_usage_quiet_margin:
            raise bad(f"kv_usage_low {self.kv_usage_low} must be >= 0 and below the quiet "
                      f"threshold {self.kv_usage_high - self.kv_usage_quiet_margin:.3f}")
        if self.max_layers_per_step < self.layers_per_step:
            raise bad(f"max_layers_per_step {self.max_layers_per_step} is below "
                      f"layers_per_step {self.layers_per_step}")
        for field in ("persist_steps", "layers_per_step", "restore_layers_per_step"):
            if getattr(self, field) < 1:
                raise bad(f"{field} must be >= 1, got {getattr(self, field)}")
        for field in ("queue_delay_high_s", "restore_quiet_s", "cooldown_s"):
            if getattr(self, field) < 0:
                raise bad(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.restore_hold_max_s < self.restore_quiet_s:
            raise bad(f"restore_hold_max_s {self.restore_hold_max_s} is below restore_quiet_s "
                      f"{self.restore_quiet_s}")
        seq = self.bits_sequence
        if not seq or any(b >= FULL_PRECISION_BITS or b < 1 for b in seq) or any(
            a <= b for a, b in zip(seq, seq[1:])
        ):
            raise bad(f"bits_sequence must be non-empty, strictly decreasing and below "
                      f"{FULL_PRECISION_BITS}, got {seq}")


# Steps are scheduler observations (tens of ms apart under load, a second apart on an idle
# scheduler with --sleep-on-idle), so step counts are small noise filters; every time in the
# table is wall time.
MODES: dict[str, ModePolicy] = {
    # Quality first: act late (near-full KV, or a request that would wait a whole second for
    # KV), degrade one layer at a time and to 8 bits before anything goes to 4, restore early
    # and several layers at once.
    "accuracy": ModePolicy(
        name="accuracy",
        kv_usage_high=0.92,
        queue_delay_high_s=1.0,
        persist_steps=5,
        layers_per_step=1,
        max_layers_per_step=4,
        bits_sequence=(8, 4),
        kv_usage_quiet_margin=0.1,
        kv_usage_low=0.6,
        restore_quiet_s=3.0,
        restore_hold_max_s=10.0,
        restore_layers_per_step=4,
        cooldown_s=1.0,
    ),
    # Balanced: W8 first (within 0.4% of full-precision perplexity here, against +18% for all
    # W4), W4 only once every swappable layer is at W8. Acts on a request that would wait 0.4 s
    # for KV (a fifth of a 2 s TTFT target) by freeing what every waiting request needs in one
    # action; restores after 10 s of quiet, 3 layers per quiet window, so the first lull after
    # a burst gives the capacity back over tens of seconds rather than at once (the next burst
    # is likely that close: the Azure traces' bursts come 10-30 s apart), and only while the KV
    # would stay under half full.
    "default": ModePolicy(
        name="default",
        kv_usage_high=0.8,
        queue_delay_high_s=0.4,
        persist_steps=2,
        layers_per_step=3,
        max_layers_per_step=24,
        bits_sequence=(8, 4),
        kv_usage_quiet_margin=0.1,
        kv_usage_low=0.5,
        restore_quiet_s=10.0,
        restore_hold_max_s=30.0,
        restore_layers_per_step=3,
        cooldown_s=0.5,
    ),
    # Latency first: straight to W4, act early and in bigger steps, keep the capacity longer (a
    # burst that just ended is the best predictor of the next one) and give it back slowly.
    "performance": ModePolicy(
        name="performance",
        kv_usage_high=0.75,
        queue_delay_high_s=0.1,
        persist_steps=2,
        layers_per_step=4,
        max_layers_per_step=16,
        bits_sequence=(4,),
        kv_usage_quiet_margin=0.1,
        kv_usage_low=0.4,
        restore_quiet_s=10.0,
        restore_hold_max_s=60.0,
        restore_layers_per_step=2,
        cooldown_s=0.25,
    ),
}


def get_mode(name: str) -> ModePolicy:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(
            f"unknown morph mode {name!r}; choose from {', '.join(sorted(MODES))}"
        ) from None
