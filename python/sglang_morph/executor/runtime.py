"""MorphServe runtime inside SGLang's scheduler process: budget, swaps, KV resizing, control.

One ``MorphRuntime`` per scheduler. Everything it changes it changes on the scheduler thread,
between two forward passes: from the per-step hook (before ``get_next_batch_to_run``) for the
controller's decisions and from the request dispatcher for ``/morph/*`` commands. On CUDA the
device is synchronized first, so no in-flight forward reads a weight or KV buffer being replaced.

A swap to fewer bits installs the variant layer by layer and then grows the KV pool by what the
budget has free; a restore first takes KV back (evicting cache, moving live KV below the new
boundary) and only then puts full-precision weights back. Either completes for all the layers
it names or changes nothing it cannot undo: a restore that cannot get its memory back now is
refused (409) and the layers stay quantized.
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

from sglang_morph.config import FULL_PRECISION_BITS, MorphConfig
from sglang_morph.control.budget import MemoryBudget
from sglang_morph.control.controller import LayerCosts, MorphController, SwapLayers
from sglang_morph.control.policy import get_mode
from sglang_morph.control.signals import PressureMonitor, PressureSignals, PressureSnapshot
from sglang_morph.executor.kv_resizer import KVResizer, KVResizeRefused

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


class MorphRequestError(ValueError):
    """A control request that cannot be applied; ``status_code`` is its HTTP status."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


@dataclasses.dataclass(frozen=True)
class Transition:
    time_unix_s: float
    action: str  # "swap" (to fewer bits) or "restore" (to more bits)
    source: str  # "controller", "api" or "startup"
    layers: tuple[int, ...]
    from_bits: tuple[int, ...]
    to_bits: int
    freed_bytes: int  # weight bytes freed (negative: reclaimed by a restore)
    kv_capacity_tokens_before: int
    kv_capacity_tokens_after: int
    kv_moved_tokens: int
    kv_evicted_tokens: int
    duration_s: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        self.resizer = KVResizer(scheduler)
        self.kv_bytes_per_token = self.resizer.kv_bytes_per_token
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
        self.transitions_total = 0
        self.swap_order = self._swap_order()
        self.mode = cfg.mode
        self.monitor = PressureMonitor()
        self.last_signals: PressureSignals | None = None
        self.controller = self._make_controller() if cfg.controller_enabled else None
        self._log = open(cfg.log_path, "a", buffering=1) if cfg.log_path else None
        reporter = getattr(scheduler, "metrics_reporter", None)
        self._metrics = _Metrics() if getattr(reporter, "enable_metrics", False) else None
        self._next_sample_s = 0.0
        self.hook_calls_total = 0
        self.hook_seconds_total = 0.0
        self._next_idle_check_s = 0.0
        self._resized_since_check = False
        # A static precision map already freed weight memory: it becomes KV at once.
        before = self.resizer.capacity_tokens
        self._grow_kv_into_free()
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

    # ----- state -----------------------------------------------------------------------------

    @property
    def layer_bits(self) -> tuple[int, ...]:
        if self.installer is None:
            return (FULL_PRECISION_BITS,) * self.num_layers
        return self.installer.bits

    @property
    def available_bits(self) -> tuple[int, ...]:
        if self.installer is None:
            return (FULL_PRECISION_BITS,)
        return tuple(sorted(set(self.installer.manifest.bits_available) | {FULL_PRECISION_BITS}))

    def _swap_order(self) -> tuple[int, ...]:
        from sglang_morph.engines.swap_order import front_to_back, load_swap_order

        if self.cfg.swap_order_path is None:
            return front_to_back(self.num_layers)
        return load_swap_order(self.cfg.swap_order_path, self.num_layers)

    def _make_controller(self) -> MorphController | None:
        if self.installer is None:
            return None
        manifest = self.installer.manifest
        # Quantized sizes as stored; full precision as served (the served dtype may differ).
        layer_bytes = {b: manifest.variant(0, b).device_bytes for b in self.available_bits}
        layer_bytes[FULL_PRECISION_BITS] = self.installer.full_precision_bytes(0)
        costs = LayerCosts(
            layer_bytes_by_bits=layer_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            page_size_tokens=self.resizer.page_size,
        )
        bits = tuple(b for b in self.available_bits if b != FULL_PRECISION_BITS)
        # Layers a --morph-precision-map quantized at startup are the operator's static choice:
        # the controller neither takes them lower nor "restores" them to 16 bits when quiet.
        start_bits = self.layer_bits
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
            "mode": self.mode,
            "controller": self.controller is not None,
            "layers": [{"index": i, "bits": bits} for i, bits in enumerate(self.layer_bits)],
            "quantized_layers": sum(bits != FULL_PRECISION_BITS for bits in self.layer_bits),
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
            "signals": dataclasses.asdict(self.last_signals) if self.last_signals else None,
            "retractions_total": retractions_total,
            "hook_calls_total": self.hook_calls_total,
            "hook_seconds_total": self.hook_seconds_total,
            "transitions_total": self.transitions_total,
            "transitions": [t.to_json() for t in self.transitions],
        }

    # ----- per-step hook ---------------------------------------------------------------------

    def on_step(self) -> None:
        """Called before every ``get_next_batch_to_run``: sample, decide, act (rate-limited)."""
        started = time.perf_counter()
        try:
            self._on_step()
        finally:
            # Self-measured so the hook's overhead can be read off /morph/status.
            self.hook_calls_total += 1
            self.hook_seconds_total += time.perf_counter() - started

    def _on_step(self) -> None:
        now = time.monotonic()
        if now < self._next_sample_s:
            return
        self._next_sample_s = now + SAMPLE_INTERVAL_S
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
        running = s.running_batch.reqs if s.running_batch is not None else []
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
        if self.controller is not None:
            action = self.controller.decide(self.last_signals, self.layer_bits)
            if action is not None:
                try:
                    self.apply(action, source="controller")
                except MorphRequestError as e:
                    logger.info("sglang-morph: controller action not applied: %s", e)
        if self._metrics is not None:
            self._metrics.kv_used_tokens.set(snapshot.kv_used_tokens)
        idle = not waiting and snapshot.num_running_reqs == 0
        if idle and self._resized_since_check and now >= self._next_idle_check_s:
            self._next_idle_check_s = now + IDLE_CHECK_INTERVAL_S
            self._resized_since_check = False
            self.check_integrity()

    # ----- commands --------------------------------------------------------------------------

    def handle_control(self, req: Any) -> Any:
        """The scheduler's dispatcher entry for ``MorphControlReq`` (between batches)."""
        from sglang_morph.server.messages import MorphControlReqOutput

        try:
            payload = json.loads(req.payload_json)
            if req.command == "swap":
                self.apply(self.validate_swap(payload["layers"], payload["bits"]), source="api")
            elif req.command == "mode":
                self.set_mode(payload["mode"])
            elif req.command != "status":
                raise MorphRequestError(f"unknown morph command {req.command!r}")
            code, body = 200, self.status()
        except MorphRequestError as e:
            code, body = e.status_code, {"error": str(e)}
        except Exception as e:  # the scheduler must keep serving; the caller gets the reason
            logger.exception("sglang-morph: control command %s failed", req.command)
            code, body = 500, {"error": f"{type(e).__name__}: {e}"}
        return MorphControlReqOutput(rid=req.rid, status_code=code, body_json=json.dumps(body))

    def set_mode(self, mode: str) -> None:
        try:
            policy = get_mode(mode)
        except ValueError as e:
            raise MorphRequestError(str(e)) from None
        self.mode = mode
        if self.controller is not None:
            self.controller.set_policy(policy)

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
        raised = [i for i in layers if self.layer_bits[i] < bits < FULL_PRECISION_BITS]
        if raised:
            raise MorphRequestError(
                f"layers {raised} are below {bits} bits; a layer goes up only to full precision "
                f"(bits 16)")
        return SwapLayers(tuple(layers), bits, "POST /morph/swap")

    def apply(self, action: SwapLayers, source: str) -> list[Transition]:
        """Apply one action; a mixed request (some layers up, some down) is two transitions."""
        if self.installer is None:
            raise MorphRequestError("no layer variants: start the server with --morph-engines PATH")
        current = self.layer_bits
        up = [i for i in action.layers if current[i] < action.bits]
        down = [i for i in action.layers if current[i] > action.bits]
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # no forward in flight reads what is replaced
        out = []
        if up:
            out.append(self._restore(up, action.bits, source, action.reason))
        if down:
            out.append(self._swap_down(down, action.bits, source, action.reason))
        return out

    def _set_layers(self, layers: list[int], bits: int) -> int:
        """Move ``layers`` to ``bits`` through the budget; returns the weight bytes freed."""
        freed = 0
        for i in layers:
            t = self.installer.set_layer_bits(i, bits)
            delta = t.device_bytes_after - t.device_bytes_before
            self.budget = self.budget.moved(weight_delta_bytes=delta)
            freed -= delta
        return freed

    def _swap_down(self, layers: list[int], bits: int, source: str, reason: str) -> Transition:
        started = time.perf_counter()
        from_bits = tuple(self.layer_bits[i] for i in layers)
        freed = self._set_layers(layers, bits)
        before = self.resizer.capacity_tokens
        self._grow_kv_into_free()
        return self._record(Transition(
            time.time(), "swap", source, tuple(layers), from_bits, bits, freed, before,
            self.resizer.capacity_tokens, 0, 0, time.perf_counter() - started, reason))

    def _grow_kv_into_free(self) -> None:
        before = self.resizer.capacity_tokens
        resize = self.resizer.grow(self.budget.free_bytes // self.kv_bytes_per_token)
        self.budget = self.budget.moved(
            kv_delta_bytes=(resize.new_capacity_tokens - before) * self.kv_bytes_per_token)

    def _restore(self, layers: list[int], bits: int, source: str, reason: str) -> Transition:
        started = time.perf_counter()
        from_bits = tuple(self.layer_bits[i] for i in layers)
        if bits != FULL_PRECISION_BITS:
            raise MorphRequestError("a layer goes up only to full precision (bits 16)")
        need_bytes = sum(self.installer.full_precision_bytes(i) - self.installer.layer_device_bytes(i)
                         for i in layers)
        before = self.resizer.capacity_tokens
        shortfall = need_bytes - self.budget.free_bytes
        moved = evicted = 0
        if shortfall > 0:
            page = self.resizer.page_size
            tokens = math.ceil(shortfall / self.kv_bytes_per_token / page) * page
            try:
                resize = self.resizer.shrink(tokens)
            except KVResizeRefused as e:  # the resizer refused and changed nothing
                raise MorphRequestError(
                    f"cannot restore layers {layers} now: the KV pool must give back {tokens} "
                    f"tokens ({e})", status_code=409) from e
            self.budget = self.budget.moved(
                kv_delta_bytes=(resize.new_capacity_tokens - before) * self.kv_bytes_per_token)
            moved, evicted = resize.moved_tokens, resize.evicted_tokens
        freed = self._set_layers(layers, bits)
        # The shrink rounds up to whole pages: what it took beyond the need goes back to KV.
        self._grow_kv_into_free()
        return self._record(Transition(
            time.time(), "restore", source, tuple(layers), from_bits, bits, freed, before,
            self.resizer.capacity_tokens, moved, evicted, time.perf_counter() - started, reason))

    def _record(self, t: Transition) -> Transition:
        self.transitions.append(t)
        self.transitions_total += 1
        self._resized_since_check = True
        logger.info(
            "sglang-morph: %s layers %s %s -> %d bits (%s); freed %d bytes; KV %d -> %d tokens "
            "(%d moved); %.3f s", t.action, list(t.layers), list(t.from_bits), t.to_bits,
            t.source, t.freed_bytes, t.kv_capacity_tokens_before, t.kv_capacity_tokens_after,
            t.kv_moved_tokens, t.duration_s)
        if self._log is not None:
            self._log.write(json.dumps(t.to_json()) + "\n")
        if self._metrics is not None:
            self._metrics.transitions.labels(action=t.action).inc()
        self._publish_metrics()
        return t

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
            m.layer_bits.labels(layer=str(i)).set(bits)


class _Metrics:
    """Prometheus series of the scheduler process (SGLang's multiprocess registry serves them
    on /metrics when --enable-metrics is on)."""

    def __init__(self):
        from prometheus_client import Counter, Gauge

        def gauge(name, doc, labels=()):
            return Gauge(f"sglang_morph_{name}", doc, labels, multiprocess_mode="mostrecent")

        self.kv_capacity_tokens = gauge("kv_capacity_tokens", "KV cache capacity in tokens")
        self.kv_used_tokens = gauge("kv_used_tokens", "KV tokens held by requests")
        self.quantized_layers = gauge("quantized_layers", "Decoder layers below 16 bits")
        self.layer_bits = gauge("layer_bits", "Bit-width of each decoder layer", ("layer",))
        self.memory_budget_bytes = gauge("memory_budget_bytes", "Weights + KV budget")
        self.weight_bytes = gauge("weight_bytes", "Model weight bytes now")
        self.kv_bytes = gauge("kv_bytes", "KV pool bytes now")
        self.transitions = Counter("sglang_morph_transitions", "Layer transitions", ("action",))
