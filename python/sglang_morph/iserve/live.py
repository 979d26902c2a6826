"""Fingerprints inside one server (``--enable-iserve-profiling``): the depth a forward runs,
set at runtime.

A fingerprint is the model cut to its first ``n`` decoder layers. Launching one server per
depth pays SGLang's start-up per depth, and the launches disagree by more than the depths
differ (``docs/iserve.md``, launch noise); so ``iserve profile --in-server`` launches the full
model once per parallel layout and walks the depths here and the precisions with ``POST
/morph/swap``.

``POST /iserve/depth {"layers": n}``: from the next batch on, each forward runs the first
``n`` decoder layers and then the final norm and the LM head, as the ``n``-layer model would.
Under pipeline parallelism ``n`` is split over the stages as SGLang splits an ``n``-layer model
(``space.stage_layers``) and each stage runs the first layers of its own range: the timing of
an ``n``-layer pipeline (the layers are not the model's first ``n``). ``{"layers": null}``
runs every layer again. Set only while the server is idle (409 otherwise); the radix cache is
emptied with it, since a prefix cached at another depth lacks the KV of the layers it skipped.

The hook (around ``LlamaModel.forward``) lowers the model's ``end_layer`` for the call and puts
it back, so SGLang's own loop, norm and LM head run unchanged.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from fastapi import Request
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from sglang_morph import surface as sym
from sglang_morph.config import ConfigError, is_int
from sglang_morph.elastic.kv_resizer import evict_cached_prefixes
from sglang_morph.elastic.registry import Mechanism, routes_in_launcher
from sglang_morph.iserve.space import stage_layers
from sglang_morph.surface import HOOK_LLAMA_FORWARD, IN_SCHEDULER, Hook

logger = logging.getLogger("sglang_morph.iserve")

SERVER_ARGS_ATTR = "_iserve_profiling"
_OK, _BAD, _BUSY = 200, 400, 409


class IServeDepthReq(BaseReq, kw_only=True):
    """``POST /iserve/depth`` (``layers``: the depth; None: every layer) and ``GET
    /iserve/depth`` (``query``). ``accepted``: stage 0's decision, which the later pipeline
    stages follow (SGLang forwards the request to them after stage 0 handled it)."""

    layers: int | None = None
    query: bool = False
    accepted: bool | None = None


hook_custom_types(IServeDepthReq)


class DepthError(Exception):
    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


class DepthControl:
    """One scheduler's depth. Invariants (``check_integrity``): ``1 <= run_layers <= own
    layers``; the model's ``end_layer`` is its own outside a forward."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.model = scheduler.tp_worker.model_runner.model.model  # LlamaModel
        group = self.model.pp_group
        self.stage, self.stages = group.rank_in_group, group.world_size
        self.tp_rank = int(getattr(scheduler, "tp_rank", 0) or 0)
        self.num_layers = int(scheduler.model_config.num_hidden_layers)
        self.start_layer, self.end_layer = self.model.start_layer, self.model.end_layer
        self.depth = self.num_layers  # the model's depth as served: all layers
        self.run_layers = self.end_layer - self.start_layer
        self.model.iserve_depth = self

    # ---- the forward ----

    def forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        own = self.end_layer - self.start_layer
        if self.run_layers == own:
            return original(self.model, *args, **kwargs)
        self.model.end_layer = self.start_layer + self.run_layers
        try:
            return original(self.model, *args, **kwargs)
        finally:
            self.model.end_layer = self.end_layer

    # ---- control ----

    def handle_control(self, req: IServeDepthReq) -> Any:
        from sglang_morph.elastic.control import ControlOutput, replica_index

        code, body = _OK, None
        if not req.query:
            try:
                self._set(req)
            except DepthError as e:
                code, body = e.status_code, {"error": str(e)}
        out = ControlOutput(rid=req.rid, status_code=code, body=body or self.status(),
                            replica=replica_index())
        # Stage 0's TP rank 0 answers for all: the later stages and ranks see the request in
        # the same order as every batch after it, so they have applied it before the next
        # batch reaches them.
        return out if self.stage == 0 and self.tp_rank == 0 else None

    def _set(self, req: IServeDepthReq) -> None:
        depth = self.num_layers if req.layers is None else req.layers
        if self.stage > 0 and req.accepted is not None:
            if req.accepted:  # stage 0 decided from the same state
                self._apply(depth)
            return
        if not self.stages <= depth <= self.num_layers:
            req.accepted = False
            raise DepthError(f"'layers' must be between {self.stages} (one layer per pipeline "
                             f"stage) and the model's {self.num_layers}, got {depth}", _BAD)
        if not self.scheduler.is_fully_idle():
            req.accepted = False
            raise DepthError("the server is serving requests; set the depth while it is idle",
                             _BUSY)
        self._apply(depth)
        req.accepted = True

    def _apply(self, depth: int) -> None:
        run = stage_layers(depth, self.stages)[self.stage]
        evict_cached_prefixes(self.scheduler.tree_cache)
        self.depth, self.run_layers = depth, run
        logger.info("sglang-morph: iserve depth %d (stage %d runs layers %d-%d)", depth,
                    self.stage, self.start_layer, self.start_layer + run - 1)

    def status(self) -> dict[str, Any]:
        return {"layers": self.depth, "num_layers": self.num_layers,
                "stages": [{"stage": s, "layers": n}
                           for s, n in enumerate(stage_layers(self.depth, self.stages))]}

    def check_integrity(self) -> None:
        assert 1 <= self.run_layers <= self.end_layer - self.start_layer, self.run_layers
        assert self.model.end_layer == self.end_layer, "end_layer left lowered"


# ---- registration ----


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sglang-morph iServe profiling", "Fingerprints inside one server (POST /iserve/depth).")
    group.add_argument(
        "--enable-iserve-profiling", action="store_true",
        help="Let POST /iserve/depth set how many decoder layers each forward runs (what "
        "`python -m sglang_morph.iserve profile --in-server` measures); every layer runs "
        "until it is set.")


def configure(server_args: Any, args: Any, enabled_before: frozenset[str]) -> bool:
    enabled = bool(getattr(args, "enable_iserve_profiling", False))
    if enabled:
        for other in ("kunserve", "amoebas"):
            if other in enabled_before:
                raise ConfigError(f"--enable-iserve-profiling and --enable-{other} together "
                                  f"are not supported: both run their own forward")
    setattr(server_args, SERVER_ARGS_ATTR, enabled)
    return enabled


def add_routes(app: Any) -> None:
    from fastapi.responses import JSONResponse
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from sglang_morph.elastic.control import control_client, json_object, not_running

    async def forward(req: IServeDepthReq) -> Any:
        client = control_client()
        if client is None:
            return not_running("iServe profiling")
        outs = await client.call(req)
        failed = [o for o in outs if o.status_code != _OK]
        body = outs[0].body if len(outs) == 1 else {"replicas": [o.body for o in outs]}
        return JSONResponse(failed[0].body if failed else body,
                            status_code=failed[0].status_code if failed else _OK)

    async def iserve_depth_status():
        """The depth each forward runs, and each pipeline stage's share of it.

        Answers: 200 with ``{"layers": n, "num_layers": N, "stages": [{"stage": 0, "layers":
        n}]}``; 503 when iServe profiling is not enabled in this server.
        """
        return await forward(IServeDepthReq(query=True))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def iserve_depth(request: Request):
        """Run the first ``layers`` decoder layers in each forward from the next batch on
        (split over the pipeline stages as an ``n``-layer model would be), as the
        ``n``-layer fingerprint of the model; ``null`` runs every layer.

        Body: ``{"layers": n}``.

        Answers: 200 with the new depth (as ``GET /iserve/depth``); 400 with ``{"error": ...}``
        for a bad body or a depth outside [stages, layers]; 409 while requests are being
        served (nothing changed); 503 when iServe profiling is not enabled in this server.
        """
        body = await json_object(request)
        if body is None or set(body) != {"layers"} or not (
                body["layers"] is None or is_int(body["layers"])):
            return JSONResponse({"error": "the body must be {\"layers\": n} with n an integer "
                                 "number of decoder layers (null: every layer)"},
                                status_code=_BAD)
        return await forward(IServeDepthReq(layers=body["layers"]))

    app.add_api_route("/iserve/depth", iserve_depth_status, methods=["GET"])
    app.add_api_route("/iserve/depth", iserve_depth, methods=["POST"])


def attach(scheduler: Any):
    from sglang.utils import TypeBasedDispatcher

    control = DepthControl(scheduler)
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(IServeDepthReq, control.handle_control)])
    scheduler.iserve_depth = control
    return None, control.status


def around_llama_forward(original: Callable[..., Any], model: Any, *args: Any,
                         **kwargs: Any) -> Any:
    control = model.__dict__.get("iserve_depth")
    if control is None:
        return original(model, *args, **kwargs)
    return control.forward(original, *args, **kwargs)


HOOKS: tuple[Hook, ...] = (
    Hook(HOOK_LLAMA_FORWARD, around_llama_forward, "AROUND", only_if_imported=IN_SCHEDULER),
)

MECHANISM = Mechanism(
    name="iserve",
    flag="--enable-iserve-profiling",
    add_cli_args=add_cli_args,
    configure=configure,
    enabled=lambda server_args: bool(getattr(server_args, SERVER_ARGS_ATTR, False)),
    hooks=lambda: HOOKS,
    symbols=lambda: sym.ISERVE_SYMBOLS,
    launcher_setup=routes_in_launcher(add_routes),
    attach=attach,
    add_routes=add_routes,
)
