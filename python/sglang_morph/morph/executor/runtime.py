"""MorphServe runtime inside SGLang's scheduler process: budget, swaps, KV resizing, control.

One ``MorphRuntime`` per scheduler. Everything it changes it changes on the scheduler thread,
between two forward passes: from the per-step hook (before ``get_next_batch_to_run``) for the
controller's decisions and from the request dispatcher for ``/morph/*`` commands. On CUDA the
device is synchronized first, so no in-flight forward reads a weight or KV buffer being replaced.

A transition is all or nothing, on the API path and the controller's alike. A swap to fewer
bits prepares every tensor of every layer it moves (from the variants staged in host memory at
startup; the engines directory is never read while serving), then installs them and grows the
KV pool by what the budget has free; a failed grow puts the layers back. A restore prepares,
then takes KV back (evicting cache, moving live KV below the new boundary), then puts the
full-precision weights back; if that fails, the KV pool grows back to its old capacity. A
transition that is refused (409: the live KV does not fit the smaller pool) or fails (500) is
logged and recorded in ``transitions`` with its reason, leaves layers, KV capacity and budget
as they were, and the scheduler keeps serving.

Layers an operator moved with ``POST /morph/swap`` are pinned: the controller leaves them where
they are until a swap with ``"pin": false`` hands them back.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import time
from typing import Any

import torch
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.morph.config import MorphConfig
from sglang_morph.elastic.budget import MemoryBudget
from sglang_morph.morph.control.controller import LayerCosts, MorphController, SwapLayers
from sglang_morph.morph.control.policy import get_mode
from sglang_morph.morph.control.signals import PressureMonitor, PressureSignals, PressureSnapshot
from sglang_morph.faults import FaultInjector, InjectedFault
from sglang_morph.elastic.kv_resizer import KVResizer, KVResizeRefused
from sglang_morph.elastic.contract import Outcome
from sglang_morph.elastic.contract import Transition as ElasticTransition
from sglang_morph.elastic.control import SKIPPED, replica_index
from sglang_morph.elastic.loop import ElasticLoop
from sglang_morph.morph.records import MorphRequestError, Transition
from sglang_morph.elastic.record import recorder

logger = logging.getLogger("sglang_morph")

# The controller samples the scheduler at most this often: a snapshot is O(waiting + running
# requests) (the oldest waiting request is not always at the head of a policy-sorted queue,
# and admission needs and reservations are per request).
SAMPLE_INTERVAL_S = 0.02
# An idle scheduler checks KV integrity at most this often, and only after a resize.
IDLE_CHECK_INTERVAL_S = 5.0
RECENT_TRANSITIONS = 64

# Retracted requests since start, counted by a hook on ScheduleBatch.retract_decode.
retractions_total = 0


def count_retractions(result: Any, *_args: Any, **_kwargs: Any) -> None:
    global retractions_total
    retractions_total += len(result[0])


def _admission_tokens(req: Any, new_token_ratio: float) -> float:
    """KV tokens a waiting request needs to be admitted: its prompt plus its reserved output."""
    return len(req.origin_input_ids) + _future_tokens(req, new_token_ratio)


def _future_tokens(req: Any, new_token_ratio: float) -> float:
    """KV tokens SGLang's admission reserves for a request's remaining output: what is left of
    max_new_tokens (clipped), scaled by the scheduler's new-token ratio unless ignore_eos fixes
    the length (schedule_policy.PrefillAdder does the same)."""
    params = req.sampling_params
    left = min(params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
    return max(0, left) * (1.0 if params.ignore_eos else new_token_ratio)


def model_weight_bytes(model: torch.nn.Module, installer: Any) -> int:
    """Bytes of every parameter and buffer (shared storages once) plus installed variants."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    if installer is not None:  # quantized layers' tensors are not Parameters
        total += sum(installer.layer_device_bytes(i) for i, bits in enumerate(installer.bits)
                     if bits != FULL_PRECISION_BITS)
    return total


def layer_costs(installer: Any, bits_available: tuple[int, ...], kv_bytes_per_token: int,
                page_size_tokens: int) -> LayerCosts:
    """What the controller prices a layer at: the exact bytes this process's installer holds
    for a layer at each bit-width (layers are alike), against this process's KV bytes per token.

    Read off the installer, not the engines manifest: the manifest sizes a whole layer as
    stored, while a tensor-parallel rank holds only its shard (a third of the layer at TP 3,
    plus the scales a row-parallel shard keeps whole), and the kernels lay the stored tensors
    out anew (scales in the activation dtype, padding, packing). A whole-layer W8 size against a
    rank's bf16 shard would price W8 above full precision and move KV by the wrong tokens."""
    return LayerCosts(
        layer_bytes_by_bits={b: installer.device_bytes_at(0, b) for b in bits_available},
        kv_bytes_per_token=kv_bytes_per_token,
        page_size_tokens=page_size_tokens,
    )


class _ControllerOnSignals:
    """The elastic core's ``Controller`` over ``MorphController``, which also needs each
    layer's bits and the pinned layers: the runtime holds both."""

    def __init__(self, runtime: "MorphRuntime"):
        self.runtime = runtime

    def decide(self, signals: PressureSignals) -> SwapLayers | None:
        r = self.runtime
        if r.controller is None:
            return None
        return r.controller.decide(signals, r.model_bits, pinned=frozenset(r.pinned))

    def applied(self, transition: ElasticTransition) -> None:
        """The controller reads the outcome from the runtime's state at its next decision."""


class _AsMechanism:
    """The runtime under the elastic core's ``ElasticMechanism`` names (its own ``apply``
    takes a source and serves the operator's swaps too)."""

    name = "morph"

    def __init__(self, runtime: "MorphRuntime"):
        self.observe = runtime.observe
        self.is_leader = runtime.is_leader
        self.apply = runtime.apply_decision
        self.state = runtime.elastic_state
        self.check_integrity = runtime.check_integrity


class MorphRuntime:
    """Invariants: ``budget`` equals the measured weights + KV pool bytes after every
    transition (``check_integrity``); KV capacity = capacity at start + tokens granted by swaps
    that are still in effect (exactly the start value when every layer is at 16 bits again)."""

    def __init__(self, scheduler: Any, cfg: MorphConfig):
        self.scheduler = scheduler
        self.cfg = cfg
        runner = scheduler.tp_worker.model_runner
        self.model = runner.model
        self.installer = getattr(runner, "morph_installer", None)
        self.num_layers = scheduler.model_config.num_hidden_layers
        # Test-only fault points, armed from SGLANG_MORPH_FAULT once startup is done.
        self.faults = FaultInjector()
        self.resizer = KVResizer(scheduler, self.faults)
        if self.installer is not None:
            self.installer.faults = self.faults
        # Layers an operator placed with POST /morph/swap: the controller does not move them.
        self.pinned: set[int] = set()
        # Under --dp-size each replica runs its own runtime (morph/parallel/__init__.py).
        self.replica = replica_index()
        # Precision provenance of every response (morph/provenance.py), told of each applied
        # transition by _record.
        from sglang_morph.morph.provenance import ProvenanceTracker

        self.provenance = ProvenanceTracker(self.layer_bits)
        self.kv_bytes_per_token = self.resizer.kv_bytes_per_token
        # Under pipeline parallelism: this stage's layers, budget and exchanges with the others
        # (sglang_morph.morph.parallel.pipeline); None on one rank.
        from sglang_morph.morph.parallel.pipeline import PipelineStage

        self.pipeline = PipelineStage.of(self)
        # Under tensor parallelism: the other ranks, which hold the other shards and must stay
        # alike (sglang_morph.morph.parallel.tensor); None on one rank.
        from sglang_morph.morph.parallel.tensor import TensorParallelRanks

        self.tensor = TensorParallelRanks.of(self)
        # Under either, one controller decides for all ranks (TP rank 0's, stage 0's), and its
        # actions reach the others with SGLang's own inputs (sglang_morph.morph.parallel.relay).
        from sglang_morph.morph.parallel.relay import ActionRelay

        self.relay = ActionRelay.of(self)
        weight_bytes = model_weight_bytes(self.model, self.installer)
        total = cfg.memory_budget_bytes or (
            weight_bytes + self.resizer.capacity_tokens * self.kv_bytes_per_token)
        overflow = weight_bytes + self.resizer.capacity_tokens * self.kv_bytes_per_token - total
        if overflow > 0:
            # The launcher sized the pool from the checkpoint's tensors; the model also holds
            # buffers (rotary tables) it cannot see. The budget is the limit: the still empty
            # pool gives way.
            page = self.resizer.page_size
            self.resizer.shrink(math.ceil(overflow / self.kv_bytes_per_token / page) * page)
            logger.info("sglang-morph: KV pool trimmed by %d bytes to fit the memory budget",
                        overflow)
        kv_bytes = self.resizer.capacity_tokens * self.kv_bytes_per_token
        self.budget = MemoryBudget(total, weight_bytes, kv_bytes)
        self.transitions: collections.deque[Transition] = collections.deque(maxlen=RECENT_TRANSITIONS)
        self.transitions_total = 0  # applied ones; refused and failed ones are counted apart
        self.refused_transitions_total = 0
        self.failed_transitions_total = 0
        self.swap_order = self._swap_order()
        self.mode = cfg.mode
        self.monitor = PressureMonitor()
        self.last_signals: PressureSignals | None = None
        self.controller: MorphController | None = None  # made once the ranks agreed (below)
        # (TP ranks apply the same transitions: rank 0 writes them for all)
        # Every mechanism's transitions, one log and one metrics family (the elastic core).
        self.elastic = recorder(scheduler)
        self._log = (open(cfg.log_path, "a", buffering=1)
                     if cfg.log_path and (self.tensor is None or self.tensor.rank == 0) else None)
        reporter = getattr(scheduler, "metrics_reporter", None)
        self._metrics = (_Metrics(self.replica) if getattr(reporter, "enable_metrics", False)
                         else None)
        self._last_elastic: ElasticTransition | None = None
        self.hook_calls_total = 0
        self.hook_seconds_total = 0.0
        self._next_idle_check_s = 0.0
        self._resized_since_check = False
        # A static precision map already freed weight memory: it becomes KV at once.
        before = self.resizer.capacity_tokens
        self._grow_kv_into_free()
        if self.pipeline is not None:
            self.pipeline.agree_capacity()  # one capacity for every stage
            # From here every stage knows every layer's bits (and keeps them up to date at
            # each transition): a response's provenance names all stages' layers, not only
            # those of the stage that streams it.
            self.provenance = ProvenanceTracker(self.model_bits)
        if self.tensor is not None:
            self.tensor.agree()  # equal shards and pools on every rank, or no start
        # (under PP the controller prices layers from every stage's figures, known from here)
        self.controller = self._make_controller() if cfg.controller_enabled else None
        # The elastic core's loop: rate-limited observe, the leader's decision, apply, record.
        self.loop = ElasticLoop(_AsMechanism(self), _ControllerOnSignals(self), self.elastic,
                                SAMPLE_INTERVAL_S)
        for bits in sorted(set(self.layer_bits) - {FULL_PRECISION_BITS}, reverse=True):
            # One record per bit-width, as if each group had been swapped at startup; the KV
            # growth is shown on the last one.
            layers = tuple(i for i, b in enumerate(self.layer_bits) if b == bits)
            after = (self.resizer.capacity_tokens if bits == min(self.layer_bits) else before)
            self._record(Transition(
                time.time(), "swap", "startup", layers, (FULL_PRECISION_BITS,) * len(layers),
                bits, sum(self.installer.full_precision_bytes(i)
                          - self.installer.layer_device_bytes(i) for i in layers),
                before, after, 0, 0, 0.0, "--morph-precision-map"))
            before = after
        self.kv_capacity_tokens_at_start = self.resizer.capacity_tokens
        self.check_integrity()
        self._publish_metrics()
        self.faults.arm_from_env()
        if self.faults.armed:
            logger.warning("sglang-morph: test-only fault injection armed: %s", self.faults.armed)

    # ----- state -----------------------------------------------------------------------------

    @property
    def layer_bits(self) -> tuple[int, ...]:
        if self.installer is None:
            return (FULL_PRECISION_BITS,) * self.num_layers
        return self.installer.bits

    @property
    def model_bits(self) -> tuple[int, ...]:
        """Every decoder layer's bits, those of the other pipeline stages included (what the
        controller decides from); ``layer_bits`` has only this process's layers right."""
        return tuple(self.pipeline.bits) if self.pipeline is not None else self.layer_bits

    @property
    def available_bits(self) -> tuple[int, ...]:
        if self.installer is None:
            return (FULL_PRECISION_BITS,)
        return tuple(sorted(set(self.installer.manifest.bits_available) | {FULL_PRECISION_BITS}))

    def _swap_order(self) -> tuple[int, ...]:
        from sglang_morph.morph.swap_order import front_to_back, load_swap_order

        if self.cfg.swap_order_path is None:
            return front_to_back(self.num_layers)
        return load_swap_order(self.cfg.swap_order_path, self.num_layers)

    def _make_controller(self) -> MorphController | None:
        if self.installer is None:
            return None
        if self.pipeline is not None:
            costs = self.pipeline.layer_costs()  # every stage's layers and KV, not one stage's
        else:
            costs = layer_costs(self.installer, self.available_bits, self.kv_bytes_per_token,
                                self.resizer.page_size)
        bits = tuple(b for b in self.available_bits if b != FULL_PRECISION_BITS)
        # Layers a --morph-precision-map quantized at startup are the operator's static choice:
        # the controller neither takes them lower nor "restores" them to 16 bits when quiet.
        start_bits = self.model_bits
        order = tuple(i for i in self.swap_order if start_bits[i] == FULL_PRECISION_BITS)
        return MorphController(get_mode(self.mode), order, bits, costs)

    def check_integrity(self) -> None:
        self.resizer.check_integrity()
        if self.installer is not None:
            self.installer.check_integrity()
        measured = MemoryBudget(self.budget.total_bytes,
                                model_weight_bytes(self.model, self.installer),
                                self.resizer.capacity_tokens * self.kv_bytes_per_token)
        measured.check_integrity()
        if measured != self.budget:
            raise AssertionError(f"budget drifted: tracked {self.budget}, measured {measured}")

    def status(self) -> dict[str, Any]:
        b = self.budget
        return {
            "replica": self.replica,
            "mode": self.mode,
            "controller": self.controller is not None,
            "layers": [{"index": i, "bits": bits, "pinned": i in self.pinned}
                       for i, bits in enumerate(self.layer_bits)],
            "quantized_layers": sum(bits != FULL_PRECISION_BITS for bits in self.layer_bits),
            "pinned_layers": sorted(self.pinned),
            "available_bits": list(self.available_bits),
            "swap_order": list(self.swap_order),
            "kv_capacity_tokens": self.resizer.capacity_tokens,
            "kv_capacity_tokens_at_start": self.kv_capacity_tokens_at_start,
            "kv_used_tokens": self.resizer.held_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "memory_budget_bytes": b.total_bytes,
            "weight_bytes": b.weight_bytes,
            "kv_bytes": b.kv_bytes,
            "free_budget_bytes": b.free_bytes,
            # Host memory the staged variants hold (pinned on CUDA), outside the budget.
            "staged_variants_host_bytes": (self.installer.staged.host_bytes
                                           if self.installer is not None else 0),
            # Under --tp-size every figure above is one rank's (rank 0's; all are alike).
            "tensor_parallel": self.tensor.status() if self.tensor is not None else None,
            "signals": dataclasses.asdict(self.last_signals) if self.last_signals else None,
            "retractions_total": retractions_total,
            "hook_calls_total": self.hook_calls_total,
            "hook_seconds_total": self.hook_seconds_total,
            "transitions_total": self.transitions_total,
            "refused_transitions_total": self.refused_transitions_total,
            "failed_transitions_total": self.failed_transitions_total,
            "transitions": [t.to_json() for t in self.transitions],
        }

    # ----- per-step hook ---------------------------------------------------------------------

    def on_step(self) -> None:
        """Called before every ``get_next_batch_to_run``: the elastic core's loop samples,
        decides and acts (rate-limited)."""
        started = time.perf_counter()
        try:
            if self.pipeline is not None:
                self.pipeline.forward_answers()  # stage 0: the last stage's /morph answers
            self.loop.on_step()
        finally:
            # Self-measured so the hook's overhead can be read off /morph/status.
            self.hook_calls_total += 1
            self.hook_seconds_total += time.perf_counter() - started

    # ----- what the elastic core's loop calls (through _AsMechanism) -------------------------

    def observe(self) -> PressureSignals:
        """The pressure signals of this step (and, when idle after a resize, an integrity
        check)."""
        now = time.monotonic()
        s = self.scheduler
        waiting = s.waiting_queue
        head_wait_s = 0.0
        head_need = waiting_need = 0
        ratio = s.new_token_ratio_tracker.current
        if waiting:
            head = min(waiting, key=lambda r: r.time_stats.wait_queue_entry_time)
            oldest = head.time_stats.wait_queue_entry_time
            if oldest > 0:
                head_wait_s = max(0.0, time.perf_counter() - oldest)
            head_need = _admission_tokens(head, ratio)
            waiting_need = sum(_admission_tokens(r, ratio) for r in waiting)
        running = self._running_requests()
        # Per running request: decode steps until it finishes, and the KV (held + reserved)
        # its finish gives back to admission.
        release = []
        for r in running:
            future = _future_tokens(r, ratio)
            release.append((math.ceil(future),
                            int(len(r.origin_input_ids) + len(r.output_ids) + future)))
        snapshot = PressureSnapshot(
            time_s=now,
            kv_capacity_tokens=self.resizer.capacity_tokens,
            kv_used_tokens=max(0, self.resizer.held_tokens),
            num_waiting_reqs=len(waiting),
            num_running_reqs=len(running),
            head_wait_s=head_wait_s,
            retractions_total=retractions_total,
            kv_reserved_tokens=int(sum(_future_tokens(r, ratio) for r in running)),
            head_need_tokens=int(head_need),
            waiting_need_tokens=int(waiting_need),
            scheduler_steps_total=self.hook_calls_total,
            running_kv_release=tuple(release),
        )
        self.last_signals = self.monitor.observe(snapshot)
        if self._metrics is not None:
            self._metrics.kv_used_tokens.set(snapshot.kv_used_tokens)
        idle = not waiting and snapshot.num_running_reqs == 0
        if idle and self._resized_since_check and now >= self._next_idle_check_s:
            self._next_idle_check_s = now + IDLE_CHECK_INTERVAL_S
            self._resized_since_check = False
            self.check_integrity()
        return self.last_signals

    def is_leader(self) -> bool:
        """On one rank always; under TP or PP, rank 0 or stage 0 while no action is on its way
        to the ranks (``parallel/relay.py``)."""
        return self.relay is None or self.relay.decides()

    def apply_decision(self, action: SwapLayers) -> ElasticTransition | None:
        """The controller's action: applied here on one rank (recorded, also when refused);
        under TP or PP sent to every rank, which applies it at the same point."""
        if self.relay is not None:
            self.relay.send(action)
            return None
        self._last_elastic = None
        self._apply_controller_action(action)
        return self._last_elastic

    def _running_requests(self) -> list[Any]:
        s = self.scheduler
        if self.pipeline is None:
            return s.running_batch.reqs if s.running_batch is not None else []
        # Under PP each micro-batch has its running batch (``running_batch`` is the current
        # one's); the pool holds them all.
        reqs = {id(r): r for b in getattr(s, "running_mbs", None) or [] if b is not None
                for r in b.reqs}
        return list(reqs.values())

    def _apply_controller_action(self, action: SwapLayers) -> None:
        try:
            self.apply(action, source="controller")
        except MorphRequestError as e:
            logger.info("sglang-morph: controller action not applied: %s", e)

    def handle_action(self, req: Any) -> None:
        """The dispatcher's entry for the leading rank's controller actions, on every rank."""
        if self.relay is not None:
            self.relay.received()
        # (an operator's swap in the same inputs, ahead of it, may have pinned some; pins are
        # alike on every rank)
        layers = tuple(i for i in req.layers if i not in self.pinned)
        if self.pipeline is not None:  # every stage in turn, told of the earlier ones' outcome
            return self.pipeline.handle_action(req, layers)
        if layers:
            self._apply_controller_action(SwapLayers(layers, req.bits, req.reason))

    # ----- commands --------------------------------------------------------------------------

    def handle_control(self, req: Any) -> Any:
        """The scheduler's dispatcher entry for the /morph requests (between batches)."""
        from sglang_morph.elastic.control import ControlOutput
        from sglang_morph.morph.messages import MorphModeReq, MorphSwapReq

        if getattr(req, "replica", None) not in (None, self.replica):
            return ControlOutput(rid=req.rid, status_code=SKIPPED, body={},
                                      replica=self.replica)
        if self.pipeline is not None:  # every stage in turn; the last one answers
            return self.pipeline.handle(req)
        try:
            if isinstance(req, MorphSwapReq):
                self.swap_from_api(req.layers, req.bits, pin=req.pin)
            elif isinstance(req, MorphModeReq):
                self.set_mode(req.mode)
            code, body = 200, self.status()
        except MorphRequestError as e:
            code, body = e.status_code, {"error": str(e)}
        except Exception as e:  # the scheduler must keep serving; the caller gets the reason
            logger.exception("sglang-morph: control request %s failed", type(req).__name__)
            code, body = 500, {"error": f"{type(e).__name__}: {e}"}
        out = ControlOutput(rid=req.rid, status_code=code, body=body, replica=self.replica)
        # (every TP rank handles the request here, at the same step; rank 0 answers for all)
        return self.tensor.gather(out) if self.tensor is not None else out

    def set_mode(self, mode: str) -> None:
        try:
            policy = get_mode(mode)
        except ValueError as e:
            raise MorphRequestError(str(e)) from None
        self.mode = mode
        if self.controller is not None:
            self.controller.set_policy(policy)

    def swap_from_api(self, layers: list[int], bits: int, pin: bool | None = None
                      ) -> Transition | None:
        """An operator's swap: applied like the controller's, then the layers it moved are
        pinned (``pin=True``: every layer named, moved or not; ``pin=False``: every layer named
        is handed back to the controller), and the controller's cooldown and quiet window
        restart from it. A swap that moves nothing and names no ``pin`` changes nothing."""
        swap = self.validate_swap(layers, bits)
        moved = [i for i in layers if self.layer_bits[i] != bits]
        transition = self.apply(swap, source="api")
        if pin is False:
            self.pinned.difference_update(layers)
        else:
            self.pinned.update(layers if pin else moved)
        if transition is not None and self.controller is not None:
            self.controller.note_transition(time.monotonic())  # the snapshots' clock
        return transition

    def validate_swap(self, layers: list[int], bits: int) -> SwapLayers:
        if self.installer is None:
            raise MorphRequestError("no layer variants: start the server with --morph-engines PATH")
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise MorphRequestError(
                f"unknown layers {bad}; the model has layers 0-{self.num_layers - 1}")
        if len(set(layers)) != len(layers):
            raise MorphRequestError(f"layers {layers} repeat an index")
        if bits not in self.available_bits:
            raise MorphRequestError(
                f"no {bits}-bit variant was built; available bits: {list(self.available_bits)}")
        # (Under PP a stage holds only its own layers: parallel.pipeline checks every layer's
        # bits, as every stage knows them.)
        raised = [i for i in layers if self.layer_bits[i] < bits < FULL_PRECISION_BITS
                  and self.pipeline is None]
        if raised:
            raise MorphRequestError(
                f"layers {raised} are below {bits} bits; a layer goes up only to full precision "
                f"(bits 16)")
        return SwapLayers(tuple(layers), bits, "POST /morph/swap")

    # ----- transitions -----------------------------------------------------------------------

    def apply(self, action: SwapLayers, source: str) -> Transition | None:
        """Apply one action as one transition: every layer it moves and the KV resize, or
        nothing. Layers already at ``action.bits`` are left out; None when none is left.

        Raises ``MorphRequestError`` (409 refused, 500 failed) after logging the transition
        and recording it in ``transitions``; layers, KV pool and budget are then as before.
        """
        if self.installer is None:
            raise MorphRequestError("no layer variants: start the server with --morph-engines PATH")
        if self.pipeline is not None:
            return self.pipeline.apply(action, source)
        current = self.layer_bits
        layers = [i for i in action.layers if current[i] != action.bits]
        if not layers:
            return None
        restore = action.bits == FULL_PRECISION_BITS
        if any((current[i] < action.bits) != restore for i in layers):
            raise MorphRequestError(f"layers {layers} would move both up and down; a layer goes "
                                    f"up only to full precision (bits 16)")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # no forward in flight reads what is replaced
        started = time.perf_counter()
        before = self.resizer.capacity_tokens
        from_bits = tuple(current[i] for i in layers)

        def record(action_name: str, freed: int, moved: int, evicted: int,
                   error: str = "") -> Transition:
            return self._record(Transition(
                time.time(), action_name, source, tuple(layers), from_bits, action.bits, freed,
                before, self.resizer.capacity_tokens, moved, evicted,
                time.perf_counter() - started, action.reason, error))

        try:
            if restore:
                freed, moved, evicted = self._restore(layers)
            else:
                freed, moved, evicted = self._swap_down(layers, action.bits)
        except MorphRequestError as e:  # refused before anything changed
            record("refused", 0, 0, 0, str(e))
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            logger.error("sglang-morph: %s of layers %s to %d bits (%s) failed and was undone: %s",
                         "restore" if restore else "swap", layers, action.bits, source, error,
                         exc_info=not isinstance(e, InjectedFault))
            record("failed", 0, 0, 0, error)
            self._check_after_failure()
            raise MorphRequestError(f"{'restore' if restore else 'swap'} of layers {layers} "
                                    f"failed and changed nothing: {error}", 500) from e
        return record("restore" if restore else "swap", freed, moved, evicted)

    def _swap_down(self, layers: list[int], bits: int, move: Any = None,
                   grow_tokens: int | None = None) -> tuple[int, int, int]:
        """Install ``bits``-bit variants, then grow KV into the freed bytes (or by
        ``grow_tokens``, what the pipeline's stages agreed); (freed, 0, 0)."""
        move = move or self.installer.prepare(layers, bits)
        weights_moved = self.budget.moved(weight_delta_bytes=move.weight_delta_bytes)
        if grow_tokens is None:
            grow_tokens = self._whole_pages(weights_moved.free_bytes // self.kv_bytes_per_token)
        after = weights_moved.moved(kv_delta_bytes=grow_tokens * self.kv_bytes_per_token)
        applied = self.installer.apply(move)
        try:
            self.resizer.grow(grow_tokens)
        except BaseException:
            self.installer.revert(applied)
            raise
        self.budget = after
        return -move.weight_delta_bytes, 0, 0

    def _restore(self, layers: list[int], move: Any = None,
                 shrink_tokens: int | None = None) -> tuple[int, int, int]:
        """Take back the KV the full-precision weights need (or ``shrink_tokens``, what the
        pipeline's stages agreed), then install them; if they cannot be installed, the KV pool
        grows back. Returns (freed (< 0), moved, evicted tokens)."""
        move = move or self.installer.prepare(layers, FULL_PRECISION_BITS)
        shortfall = move.weight_delta_bytes - self.budget.free_bytes
        tokens = (self._whole_pages(-(-shortfall // self.kv_bytes_per_token), up=True)
                  if shortfall > 0 else 0)
        if shrink_tokens is not None:
            tokens = shrink_tokens
        after_shrink = self.budget.moved(kv_delta_bytes=-tokens * self.kv_bytes_per_token)
        after = after_shrink.moved(weight_delta_bytes=move.weight_delta_bytes)
        moved = evicted = 0
        if tokens:
            try:
                resize = self.resizer.shrink(tokens)
            except KVResizeRefused as e:  # the resizer refused and changed nothing
                raise MorphRequestError(
                    f"cannot restore layers {layers} now: the KV pool must give back {tokens} "
                    f"tokens ({e})", status_code=409) from e
            moved, evicted = resize.moved_tokens, resize.evicted_tokens
        try:
            self.installer.apply(move)
        except BaseException:
            if tokens:
                self._give_kv_back(tokens, after_shrink)
            raise
        self.budget = after
        return -move.weight_delta_bytes, moved, evicted

    def _give_kv_back(self, tokens: int, budget_without_them: MemoryBudget) -> None:
        """After a restore failed past its shrink: grow the pool back by ``tokens``."""
        try:
            with self.faults.suppressed():
                self.resizer.grow(tokens)
        except Exception:
            # Both the restore and the grow failed: the pool stays smaller (consistently so),
            # and the budget says what is true.
            self.budget = budget_without_them
            logger.critical("sglang-morph: could not give %d KV tokens back after a failed "
                            "restore; the KV pool stays at %d tokens", tokens,
                            self.resizer.capacity_tokens, exc_info=True)
            raise

    def _whole_pages(self, tokens: int, up: bool = False) -> int:
        page = self.resizer.page_size
        return (-(-tokens // page) if up else tokens // page) * page

    def _grow_kv_into_free(self) -> None:
        """Startup: what the budget has free (a static precision map freed it) becomes KV."""
        tokens = self._whole_pages(self.budget.free_bytes // self.kv_bytes_per_token)
        after = self.budget.moved(kv_delta_bytes=tokens * self.kv_bytes_per_token)
        self.resizer.grow(tokens)
        self.budget = after

    def _check_after_failure(self) -> None:
        """A failed transition must have changed nothing: check at once, and say so loudly if
        it did (the scheduler keeps serving either way)."""
        try:
            self.check_integrity()
        except Exception:
            logger.critical("sglang-morph: state is inconsistent after a failed transition",
                            exc_info=True)
        else:
            logger.info("sglang-morph: checked after the failed transition: layers, KV pool "
                        "and budget are consistent")

    def _record(self, t: Transition) -> Transition:
        self.transitions.append(t)
        if t.action in ("swap", "restore"):
            self.transitions_total += 1
            # Between two batches: the next pass runs at the new bits, so every live request's
            # tokens so far were produced at the old ones (a provenance boundary).
            self.provenance.observe(self.model_bits, self._live_requests)
            self._resized_since_check = True
            logger.info(
                "sglang-morph: %s layers %s %s -> %d bits (%s); freed %d bytes; KV %d -> %d "
                "tokens (%d moved); %.3f s", t.action, list(t.layers), list(t.from_bits),
                t.to_bits, t.source, t.freed_bytes, t.kv_capacity_tokens_before,
                t.kv_capacity_tokens_after, t.kv_moved_tokens, t.duration_s)
        else:
            if t.action == "refused":
                self.refused_transitions_total += 1
            else:
                self.failed_transitions_total += 1
            logger.warning("sglang-morph: %s: layers %s -> %d bits (%s): %s", t.action,
                           list(t.layers), t.to_bits, t.source, t.error)
        if self._log is not None:
            # (every replica of a --dp-size server and every stage of a --pp-size one appends
            # to the same file: say whose; a stage's line names only its own layers)
            where = {"replica": self.replica}
            if self.pipeline is not None:
                where["pp_stage"] = self.pipeline.rank
            self._log.write(json.dumps({**t.to_json(), **where}) + "\n")
        if self._metrics is not None:
            self._metrics.transitions(t.action).inc()
        if self.tensor is None or self.tensor.rank == 0:  # TP ranks apply the same ones
            self._last_elastic = self.elastic.record(self._as_elastic(t))
        self._publish_metrics()
        return t

    def _as_elastic(self, t: Transition) -> ElasticTransition:
        outcome = {"refused": Outcome.REFUSED, "failed": Outcome.FAILED}.get(t.action,
                                                                             Outcome.APPLIED)
        action = t.action if outcome is Outcome.APPLIED else (
            "restore" if t.to_bits == FULL_PRECISION_BITS else "swap")
        detail = {"source": t.source, "layers": list(t.layers), "from_bits": list(t.from_bits),
                  "to_bits": t.to_bits, "freed_bytes": t.freed_bytes,
                  "kv_moved_tokens": t.kv_moved_tokens, "kv_evicted_tokens": t.kv_evicted_tokens}
        if self.pipeline is not None:
            detail["pp_stage"] = self.pipeline.rank
        return ElasticTransition(
            mechanism="morph", replica=self.replica, action=action, reason=t.reason,
            outcome=outcome, duration_s=t.duration_s,
            capacity_before_tokens=t.kv_capacity_tokens_before,
            capacity_after_tokens=t.kv_capacity_tokens_after, time_unix_s=t.time_unix_s,
            error=t.error, detail=detail)

    def elastic_state(self) -> dict[str, Any]:
        """What ``/elastic/status`` shows of this runtime (``/morph/status`` has the rest)."""
        return {"mode": self.mode, "controller": self.controller is not None,
                "layer_bits": list(self.layer_bits),
                "quantized_layers": sum(b != FULL_PRECISION_BITS for b in self.layer_bits),
                "kv_capacity_tokens": self.resizer.capacity_tokens,
                "kv_used_tokens": self.resizer.held_tokens,
                "memory_budget_bytes": self.budget.total_bytes}

    def _live_requests(self) -> set[Any]:
        from sglang_morph.morph.provenance import live_requests

        return live_requests(self.scheduler)

    def _publish_metrics(self) -> None:
        if self._metrics is None:
            return
        m = self._metrics
        m.kv_capacity_tokens.set(self.resizer.capacity_tokens)
        m.quantized_layers.set(sum(b != FULL_PRECISION_BITS for b in self.layer_bits))
        m.memory_budget_bytes.set(self.budget.total_bytes)
        m.weight_bytes.set(self.budget.weight_bytes)
        m.kv_bytes.set(self.budget.kv_bytes)
        for i, bits in enumerate(self.layer_bits):
            m.layer_bits(i).set(bits)


class _Metrics:
    """Prometheus series of the scheduler process (SGLang's multiprocess registry serves them
    on /metrics when --enable-metrics is on)."""

    def __init__(self, replica: int):
        from prometheus_client import Counter, Gauge

        # Every series carries the data-parallel replica: under --dp-size each replica's
        # scheduler writes its own (one "mostrecent" series would show whichever wrote last).
        r = str(replica)

        def gauge(name, doc):
            return Gauge(f"sglang_morph_{name}", doc, ("replica",),
                         multiprocess_mode="mostrecent").labels(replica=r)

        self.kv_capacity_tokens = gauge("kv_capacity_tokens", "KV cache capacity in tokens")
        self.kv_used_tokens = gauge("kv_used_tokens", "KV tokens held by requests")
        self.quantized_layers = gauge("quantized_layers", "Decoder layers below 16 bits")
        layer_bits = Gauge("sglang_morph_layer_bits", "Bit-width of each decoder layer",
                           ("replica", "layer"), multiprocess_mode="mostrecent")
        self.layer_bits = lambda layer: layer_bits.labels(replica=r, layer=str(layer))
        self.memory_budget_bytes = gauge("memory_budget_bytes", "Weights + KV budget")
        self.weight_bytes = gauge("weight_bytes", "Model weight bytes now")
        self.kv_bytes = gauge("kv_bytes", "KV pool bytes now")
        transitions = Counter("sglang_morph_transitions", "Layer transitions",
                              ("replica", "action"))
        self.transitions = lambda action: transitions.labels(replica=r, action=action)
