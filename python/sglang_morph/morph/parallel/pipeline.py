"""MorphServe under SGLang's pipeline parallelism (``--enable-morph --pp-size N``).

Every stage's scheduler runs its own ``MorphRuntime`` over the decoder layers it holds
(``start_layer``..``end_layer - 1``): it stages and installs only those layers' variants (its
share of ``--morph-precision-map``) and has its own memory budget, ``--morph-stage-budgets
A,B,...`` (one per stage) or ``--morph-memory-budget`` (the same for every stage).

**One KV capacity for the whole pipeline.** SGLang's stages are replicas of one scheduler: each
admits, batches and retracts requests on its own, from the same inputs, and the pipeline works
only while they decide alike. So every stage keeps the same KV token capacity: the most the
tightest stage allows, ``min over stages of whole_pages((budget - weights) / KV bytes per token
of its layers)``. A stage with room to spare keeps it free in its budget. A swap or a restore
moves the capacity to that minimum for the new weights (so a restore gives the exact capacity
back).

**Every stage decides alike, nobody waits.** Only stage 0 talks to the TokenizerManager;
SGLang's PP event loop hands every input it receives (our ``Morph*Req`` too) to its dispatcher
and then forwards it to the next stage, which dispatches it in the same loop iteration, before
scheduling: the same logical point of the (replicated) schedule on every stage. A blocking
exchange between stages there deadlocks: a later stage may still wait for data an earlier one
sends only after it. So at startup (before serving) the stages tell each other their budgets,
weights and every layer's bytes at every bit-width, and from then on each stage decides every
transition from that shared state alone (which layers move, refusals, the KV tokens after the
move) and applies its own part: all stages refuse alike or apply alike. Each stage adds its
outcome and ``/morph/status`` to the request before SGLang forwards it; the last stage answers
for the pipeline. Its answer goes back to stage 0 (a zmq PUSH to a PULL socket stage 0 binds at
startup, on 127.0.0.1 or, with ``--nnodes`` above 1, on the ``--dist-init-addr`` host, which
every node reaches), and stage 0 hands it to the TokenizerManager on SGLang's own socket: the
last stage may run on another node, where the TokenizerManager's ipc socket does not exist.

**Failures.** A stage whose own apply fails (an error, not a refusal) undoes its part, as on
one rank, and later stages, seeing it in the request, change nothing. If a stage fails after
earlier stages applied the transition, those cannot hear of it: the answer (500) and a
critical log line say that the stages now disagree (restart the server). A stage process that
dies mid-transition is not covered either (SGLang's pipeline ends with it).

**One controller decides** (``parallel/relay.py``): stage 0's. It receives from the
TokenizerManager, and its scheduler's KV pool and queues are the pipeline's (every stage admits
and batches the same requests, with the same KV capacity). It decides from every layer's bits
(``bits``) and walks the global swap order (the LIS order over all layers), so an action may
name layers of any stage. The action joins stage 0's inputs for the next step (the plugin's
hook on ``Scheduler._poll_timeout_aborts``, which SGLang calls on stage 0 only), and SGLang
forwards it down the pipeline like a ``/morph`` request: each stage applies its part at the
same point of the schedule, through ``apply`` (refusals, budgets and the one KV capacity as for
``POST /morph/swap``). Stage 0 decides nothing more until the action came back through its own
dispatcher. A stage that fails after earlier ones applied (the case above) logs it critically;
stage 0 cannot hear of it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.morph.config import MorphConfig, MorphConfigError

logger = logging.getLogger("sglang_morph")

# /morph/status fields that are one stage's own (shown per stage, summed at the top level).
# The transition counters are not: every stage records each transition (with its own layers).
_SUMMED = ("memory_budget_bytes", "weight_bytes", "kv_bytes", "free_budget_bytes",
           "staged_variants_host_bytes")


# ----- launcher ----------------------------------------------------------------------------------

def check_launch(server_args: Any, cfg: MorphConfig) -> None:
    """Refuse, with one line, morph flags a pipeline launch cannot honour."""
    pp = getattr(server_args, "pp_size", 1) or 1
    if cfg.stage_budget_bytes is not None and len(cfg.stage_budget_bytes) != pp:
        raise MorphConfigError(
            f"--morph-stage-budgets has {len(cfg.stage_budget_bytes)} budgets for --pp-size "
            f"{pp}; give one per pipeline stage")


def stage_budget_bytes(cfg: MorphConfig, pp_rank: int) -> int | None:
    """Weights + KV budget of stage ``pp_rank`` (None: derived from SGLang's own sizing)."""
    if cfg.stage_budget_bytes is not None:
        return cfg.stage_budget_bytes[pp_rank]
    return cfg.memory_budget_bytes


def initial_kv_tokens(cfg: MorphConfig, hf_config: dict[str, Any], server_args: Any) -> int:
    """The launcher's ``--max-total-tokens`` for a pipeline with budgets: what the tightest
    stage's budget would hold without any weights. An upper bound only: each stage's runtime
    trims its still empty pool to the capacity all stages agree on, from the weights it holds."""
    from sglang.srt.distributed.utils import get_pp_indices  # reads SGLANG_PP_LAYER_PARTITION

    from sglang_morph.morph.startup import _dtype_bytes

    pp_size = server_args.pp_size
    model_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    dtype = model_dtype if server_args.dtype == "auto" else server_args.dtype
    kv_dtype = dtype if server_args.kv_cache_dtype in ("auto", None) else server_args.kv_cache_dtype
    kv_dtype_bytes = _dtype_bytes(kv_dtype, "the KV cache")
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    per_layer = 2 * hf_config.get("num_key_value_heads", heads) * head_dim * kv_dtype_bytes
    num_layers = hf_config["num_hidden_layers"]
    tokens = []
    for rank in range(pp_size):
        try:
            start, end = get_pp_indices(num_layers, rank, pp_size)
        except ValueError as e:
            raise MorphConfigError(f"SGLANG_PP_LAYER_PARTITION: {e}") from None
        tokens.append(stage_budget_bytes(cfg, rank) // (max(end - start, 1) * per_layer))
    return min(tokens)


# ----- scheduler ---------------------------------------------------------------------------------

def stage_config(cfg: MorphConfig, scheduler: Any) -> MorphConfig:
    """``cfg`` with this stage's budget as ``memory_budget_bytes`` (what the runtime reads)."""
    group = getattr(scheduler, "pp_group", None)
    if group is None or group.world_size <= 1:
        return cfg
    return dataclasses.replace(cfg, stage_budget_bytes=None,
                               memory_budget_bytes=stage_budget_bytes(cfg, group.rank_in_group))


@dataclasses.dataclass
class _StageTable:
    """What every stage knows of stage ``stage`` (told at startup, then kept up to date by
    applying each transition the same way on every stage): enough to work out its budget."""

    stage: int
    layers: range
    budget_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    capacity_tokens: int  # what its budget alone would hold (startup)
    layer_bytes: dict[int, dict[int, int]]  # layer -> bits -> bytes of its linears at bits

    def free_bytes(self, kv_tokens: int) -> int:
        return self.budget_bytes - self.weight_bytes - kv_tokens * self.kv_bytes_per_token


class PipelineStage:
    """This scheduler's place in the pipeline.

    Invariants: every stage has the same KV capacity after startup and after every transition;
    ``bits`` (every layer's, not only this stage's) and ``tables`` are the same on every stage
    (each applies the same transitions, decided from them alone).
    """

    def __init__(self, runtime: Any, pp_group: Any, start_layer: int, end_layer: int):
        import torch.distributed as dist

        self.runtime = runtime
        self.rank, self.size = pp_group.rank_in_group, pp_group.world_size
        self.is_last = self.rank == self.size - 1
        self.layers = range(start_layer, end_layer)
        # A group of our own for the startup exchange (new_group is collective over every
        # scheduler; each one builds its runtime at startup, before serving).
        self.group = dist.new_group(ranks=list(pp_group.ranks), backend="gloo")
        self.tables: list[_StageTable] = []
        self.bits: list[int] = []
        self.capacity_tokens = 0
        # The last stage's answers to /morph requests travel to stage 0 (only it has a socket
        # to the TokenizerManager, and only on its node): stage 0 binds ``_answers`` (PULL),
        # the last stage connects ``_answer`` (PUSH) to it; the address is told at startup.
        self._zmq = None
        self._answers = None
        self._answer = None
        self._answers_endpoint = self._bind_answers() if self.rank == 0 else None

    @classmethod
    def of(cls, runtime: Any) -> "PipelineStage | None":
        group = getattr(runtime.scheduler, "pp_group", None)
        if group is None or group.world_size <= 1:
            return None
        inner = runtime.model.model
        return cls(runtime, group, inner.start_layer, inner.end_layer)

    # ----- startup -------------------------------------------------------------------------

    def agree_capacity(self) -> None:
        """Startup (before serving, so a blocking exchange is safe): tell every stage this one's
        budget, weights and per-layer bytes at every bit-width; every stage trims its still
        empty pool to the smallest stage's capacity."""
        import torch.distributed as dist

        rt = self.runtime
        table = _StageTable(
            self.rank, self.layers, rt.budget.total_bytes, rt.budget.weight_bytes,
            rt.kv_bytes_per_token, rt.resizer.capacity_tokens,
            # Without --morph-engines nothing can move (every swap is refused before it needs
            # a layer's bytes), and there is no installer to ask.
            {i: ({b: rt.installer.device_bytes_at(i, b) for b in rt.available_bits}
                 if rt.installer is not None else {}) for i in self.layers})
        tables: list[Any] = [None] * self.size
        dist.all_gather_object(tables, (table, [rt.layer_bits[i] for i in self.layers],
                                        self._answers_endpoint), group=self.group)
        self.tables = [t for t, _, _ in tables]
        self.bits = [b for _, bits, _ in tables for b in bits]
        if self.is_last:
            self._connect_answer(tables[0][2])
        common = min(t.capacity_tokens for t in self.tables)
        extra = rt.resizer.capacity_tokens - common
        if extra:
            rt.resizer.shrink(extra)
            rt.budget = rt.budget.moved(kv_delta_bytes=-extra * rt.kv_bytes_per_token)
        self.capacity_tokens = common
        logger.info("sglang-morph: pipeline stage %d of %d, layers %d-%d: KV capacity %d tokens "
                    "(stages could hold %s)", self.rank, self.size, self.layers.start,
                    self.layers.stop - 1, common, [t.capacity_tokens for t in self.tables])

    def _bind_answers(self) -> str:
        """Stage 0: a PULL socket for the last stage's answers; returns its tcp endpoint."""
        import zmq
        from sglang.srt.utils.network import NetworkAddress, get_zmq_socket_on_host

        args = self.runtime.scheduler.server_args
        host = "127.0.0.1"
        if (getattr(args, "nnodes", 1) or 1) > 1:
            # --dist-init-addr is node 0's address (stage 0 runs there), which every node reaches
            host = NetworkAddress.resolve_host(NetworkAddress.parse(args.dist_init_addr).host)
        self._zmq = zmq.Context()
        port, self._answers = get_zmq_socket_on_host(self._zmq, zmq.PULL, host=host,
                                                     restrict_peers=True)
        # An idle stage 0 sleeps in a poll of its input sockets; an answer must wake it too.
        sleeper = getattr(self.runtime.scheduler, "idle_sleeper", None)
        if sleeper is not None and hasattr(sleeper, "poller"):
            sleeper.poller.register(self._answers, zmq.POLLIN)
        return NetworkAddress(host, port).to_tcp()

    def _connect_answer(self, endpoint: str) -> None:
        """The last stage: a PUSH socket to stage 0's answers socket."""
        import zmq
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
        from sglang.srt.utils.network import get_zmq_socket

        self._zmq = zmq.Context()
        self._answer = SenderWrapper(get_zmq_socket(self._zmq, zmq.PUSH, endpoint, bind=False))

    def forward_answers(self) -> None:
        """Stage 0, every step: hand the last stage's answers to the TokenizerManager (each
        carries its route, ``http_worker_ipc``, from the request it answers)."""
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        if self._answers is None:
            return
        while True:
            try:
                out = sock_recv(self._answers, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.runtime.scheduler.ipc_channels.send_to_tokenizer.send_output(out)

    def owner(self, layer: int) -> int:
        return next(t.stage for t in self.tables if layer in t.layers)

    # ----- control requests ----------------------------------------------------------------

    def handle(self, req: Any) -> None:
        """The dispatcher's entry, on every stage in turn: stage k handles ``req`` in the same
        loop iteration as stage 0 (SGLang forwards each iteration's inputs before scheduling),
        adds what it did to ``req.pipeline_stages`` (which SGLang then forwards to stage k+1) and
        the last stage answers for all. Nothing here waits for another stage."""
        from sglang_morph.morph.records import MorphRequestError
        from sglang_morph.morph.messages import MorphModeReq, MorphSwapReq

        rt = self.runtime
        earlier = [s for s in req.pipeline_stages if s["status_code"] >= 500]
        code, error = 200, ""
        try:
            if isinstance(req, MorphSwapReq):
                if earlier:  # a stage before this one failed: it changed nothing, nor may we
                    self._skip(req, earlier[0])
                rt.swap_from_api(req.layers, req.bits, pin=req.pin)
            elif isinstance(req, MorphModeReq):
                rt.set_mode(req.mode)
        except MorphRequestError as e:
            code, error = e.status_code, str(e)
        except Exception as e:  # the scheduler must keep serving; the caller gets the reason
            logger.exception("sglang-morph: control request %s failed", type(req).__name__)
            code, error = 500, f"{type(e).__name__}: {e}"
        req.pipeline_stages.append({"stage": self.rank, "status_code": code, "error": error,
                                    "status": self.stage_status()})
        if self.is_last and self._answer is not None:
            self._answer.send_output(answer(req), req)
        return None

    def handle_action(self, req: Any, layers: tuple[int, ...]) -> None:
        """Stage 0's controller action (``parallel/relay.py``), on every stage in turn, like a
        ``POST /morph/swap``: each stage applies its part of ``layers`` (``req.layers`` but the
        pinned ones; all decide alike, from the same state) unless an earlier stage failed, and
        adds its outcome to ``req`` before SGLang forwards it. Nobody answers; the last stage
        logs it critically if stages disagree."""
        from sglang_morph.morph.control.controller import SwapLayers
        from sglang_morph.morph.records import MorphRequestError

        rt = self.runtime
        earlier = [s for s in req.pipeline_stages if s["status_code"] >= 500]
        code, error = 200, ""
        try:
            if earlier:
                self._skip(req, earlier[0], source="controller")
            if layers:
                rt.apply(SwapLayers(layers, req.bits, req.reason), source="controller")
        except MorphRequestError as e:
            code, error = e.status_code, str(e)
            logger.info("sglang-morph: controller action not applied on stage %d: %s",
                        self.rank, e)
        req.pipeline_stages.append({"stage": self.rank, "status_code": code, "error": error})
        codes = [s["status_code"] for s in req.pipeline_stages]
        if self.is_last and len(set(codes)) > 1:
            logger.critical("sglang-morph: pipeline stages disagree after a controller action "
                            "(%s -> %d bits): outcomes %s; restart the server", req.layers,
                            req.bits, req.pipeline_stages)
        return None

    def _skip(self, req: Any, failed: dict[str, Any], source: str = "api") -> None:
        from sglang_morph.morph.records import MorphRequestError, Transition

        rt = self.runtime
        error = f"stage {failed['stage']} failed: {failed['error']}"
        layers = tuple(i for i in req.layers if i in self.layers)
        rt._record(Transition(time.time(), "failed", source, layers,
                              tuple(self.bits[i] for i in layers), req.bits, 0,
                              rt.resizer.capacity_tokens, rt.resizer.capacity_tokens, 0, 0, 0.0,
                              "", error))
        raise MorphRequestError(error, 500)

    def layer_costs(self) -> Any:
        """What a layer's move is worth to stage 0's controller: a layer's bytes at each
        bit-width (layers are alike) against the pipeline's KV bytes per token (a token holds
        KV on every stage). Exact when a move frees bytes on every stage in proportion to its
        KV share; otherwise an estimate (the controller sizes actions and predicts a restore's
        usage with it): the KV change itself is what every stage agrees in ``apply``, the
        tightest stage's."""
        from sglang_morph.morph.control.controller import LayerCosts

        first = self.tables[0]
        return LayerCosts(layer_bytes_by_bits=dict(first.layer_bytes[first.layers.start]),
                          kv_bytes_per_token=sum(t.kv_bytes_per_token for t in self.tables),
                          page_size_tokens=self.runtime.resizer.page_size)

    def stage_status(self) -> dict[str, Any]:
        status = self.runtime.status()
        status["pipeline_parallel"] = {
            "pp_size": self.size,
            "controller": ("stage 0 decides from every layer's bits; its actions reach every "
                           "stage with the inputs SGLang forwards down the pipeline"
                           if self.runtime.controller is not None else None)}
        status["stage"] = self.rank
        status["layer_range"] = [self.layers.start, self.layers.stop - 1]
        status["layer_bits"] = [status["layers"][i]["bits"] for i in self.layers]
        status["pinned_layers"] = [i for i in status["pinned_layers"] if i in self.layers]
        for t in status["transitions"]:
            t["stage"] = self.rank
        return status

    # ----- transitions ---------------------------------------------------------------------

    def apply(self, action: Any, source: str) -> Any:
        """``MorphRuntime.apply`` under PP. Every stage decides from ``bits`` and ``tables``
        alone, so all decide alike: which layers move, whether the move is refused, and the KV
        capacity after it (the most the tightest stage's budget allows). Then this stage moves
        its own layers and resizes its pool by the agreed tokens. Returns this stage's
        Transition (None when no layer moves); raises MorphRequestError (4xx refused, 500
        failed: this stage changed nothing)."""
        from sglang_morph.morph.records import MorphRequestError, Transition

        rt = self.runtime
        bits, restore = action.bits, action.bits == FULL_PRECISION_BITS
        moving = [i for i in action.layers if self.bits[i] != bits]
        layers = [i for i in moving if i in self.layers]
        started, before = time.perf_counter(), rt.resizer.capacity_tokens
        from_bits = tuple(self.bits[i] for i in layers)

        def record(name: str, freed: int = 0, moved: int = 0, evicted: int = 0,
                   error: str = "") -> Any:
            return rt._record(Transition(
                time.time(), name, source, tuple(layers), from_bits, bits, freed, before,
                rt.resizer.capacity_tokens, moved, evicted, time.perf_counter() - started,
                action.reason, error))

        if not moving:
            return None
        try:
            raised = [i for i in moving if self.bits[i] < bits < FULL_PRECISION_BITS]
            if raised:
                raise MorphRequestError(
                    f"layers {raised} (on stage "
                    f"{', '.join(str(k) for k in sorted({self.owner(i) for i in raised}))}) are "
                    f"below {bits} bits; a layer goes up only to full precision (bits 16)")
            if any((self.bits[i] < bits) != restore for i in moving):
                raise MorphRequestError(f"layers {moving} would move both up and down")
            deltas = [sum(t.layer_bytes[i][bits] - t.layer_bytes[i][self.bits[i]]
                          for i in moving if i in t.layers) for t in self.tables]
            tokens = self._agreed_tokens(deltas, restore)
            if restore and tokens and not rt.resizer.can_shrink(tokens):
                raise MorphRequestError(
                    f"cannot restore layers {moving} now: the KV pool must give back {tokens} "
                    f"tokens and live requests hold them", status_code=409)
        except MorphRequestError as e:
            record("refused", error=str(e))
            raise
        try:
            move = rt.installer.prepare(layers, bits)
            if move.weight_delta_bytes != deltas[self.rank]:
                raise RuntimeError(f"the move changes this stage's weights by "
                                   f"{move.weight_delta_bytes} bytes, the stages agreed on "
                                   f"{deltas[self.rank]}")
            if restore:
                freed, moved, evicted = rt._restore(layers, move=move, shrink_tokens=tokens)
            else:
                freed, moved, evicted = rt._swap_down(layers, bits, move=move,
                                                      grow_tokens=tokens)
        except Exception as e:  # this stage's own failures undo themselves, as on one rank
            record("failed", error=f"{type(e).__name__}: {e}")
            rt._check_after_failure()
            raise MorphRequestError(f"{'restore' if restore else f'swap to {bits} bits'} of "
                                    f"layers {layers} failed on stage {self.rank} and changed "
                                    f"nothing there: {type(e).__name__}: {e}", 500) from e
        for i in moving:
            self.bits[i] = bits
        for t, delta in zip(self.tables, deltas):
            t.weight_bytes += delta
        self.capacity_tokens += -tokens if restore else tokens
        return record("restore" if restore else "swap", freed, moved, evicted)

    def _agreed_tokens(self, deltas: list[int], restore: bool) -> int:
        """A swap: the KV tokens every stage adds (the least any stage's budget allows after
        the move). A restore: the tokens every stage gives back (the most any stage needs).
        Whole pages either way."""
        rt, cap = self.runtime, self.capacity_tokens
        per_stage = []
        for t, delta in zip(self.tables, deltas):
            free = t.free_bytes(cap) - delta
            if not restore:
                per_stage.append(rt._whole_pages(free // t.kv_bytes_per_token))
            else:
                per_stage.append(rt._whole_pages(math.ceil(-free / t.kv_bytes_per_token), up=True)
                                 if free < 0 else 0)
        return max(per_stage) if restore else min(per_stage)


def answer(req: Any) -> Any:
    """The last stage's answer for the whole pipeline, from what every stage added to ``req``."""
    from sglang_morph.elastic.control import ControlOutput

    stages = req.pipeline_stages
    failed = [s for s in stages if s["status_code"] != 200]
    if not failed:
        return ControlOutput(rid=req.rid, status_code=200,
                                  body=merge_status([s["status"] for s in stages]))
    code = max(s["status_code"] for s in failed)
    if code < 500:  # every stage refused alike (each decides from the same state)
        return ControlOutput(rid=req.rid, status_code=code, body={"error": (
            f"changed nothing on any pipeline stage: {failed[0]['error']}")})
    first = min(s["stage"] for s in failed)
    applied = [s["stage"] for s in stages if s["stage"] < first]
    error = failed[0]["error"]
    if applied:
        # Earlier stages had applied it before this one failed; they cannot hear of it now.
        logger.critical("sglang-morph: stage %d failed a transition stages %s applied; the "
                        "pipeline's stages now disagree: %s", first, applied, error)
        error += (f"; stages {applied} had applied it: the stages now disagree, restart "
                  f"the server")
    return ControlOutput(rid=req.rid, status_code=code, body={"error": error})


def merge_status(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """One /morph/status for the pipeline: layers with their owners' bits, pipeline totals, the
    KV capacity every stage shares, and ``stages`` with each stage's own figures."""
    first = stages[0]
    layers = list(first["layers"])
    for s in stages:
        start, last = s["layer_range"]
        layers[start:last + 1] = s["layers"][start:last + 1]
    merged = dict(first)
    merged["layers"] = layers
    merged["quantized_layers"] = sum(1 for layer in layers if layer["bits"] != FULL_PRECISION_BITS)
    merged["pinned_layers"] = sorted(i for s in stages for i in s["pinned_layers"])
    for key in _SUMMED:
        merged[key] = sum(s[key] for s in stages)
    merged["kv_bytes_per_token"] = sum(s["kv_bytes_per_token"] for s in stages)
    merged["transitions"] = sorted((t for s in stages for t in s["transitions"]),
                                   key=lambda t: (t["time_unix_s"], t["stage"]))
    merged["stages"] = [
        {key: s[key] for key in ("stage", "layer_range", "layer_bits", "pinned_layers",
                                 "kv_capacity_tokens", "kv_used_tokens", "kv_bytes_per_token",
                                 *_SUMMED)}
        for s in stages]
    for key in ("stage", "layer_range", "layer_bits"):
        merged.pop(key)
    return merged
