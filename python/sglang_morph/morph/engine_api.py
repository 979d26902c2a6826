"""``/morph``'s operations for an in-process ``sglang.Engine``, which serves no HTTP routes.

    engine = sglang.Engine(model_path=..., enable_morph=True, ...)
    engine_api.swap(engine, [3, 7], 4)     # as POST /morph/swap {"layers": [3, 7], "bits": 4}
    engine_api.status(engine)              # as GET /morph/status
    engine_api.set_mode(engine, "performance")

Each sends the route's typed request through the Engine's TokenizerManager (the plugin gives it
the control client when morph is enabled) and returns the scheduler's answer, the status object
(``{"replicas": [...]}``, one status per replica, under ``dp_size`` N). What the route answers
with a 4xx or 5xx raises ``MorphControlError`` with that status code and message.
"""

from __future__ import annotations

from typing import Any

from sglang_morph.morph.messages import MorphModeReq, MorphStatusReq, MorphSwapReq


class MorphControlError(RuntimeError):
    """The scheduler refused or failed the operation; ``status_code`` is the route's."""

    def __init__(self, status_code: int, message: str):
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message


def _client(engine: Any) -> Any:
    client = getattr(engine.tokenizer_manager, "elastic_control", None)
    if client is None:
        raise MorphControlError(503, "sglang-morph is not running in this engine "
                                     "(build it with enable_morph=True)")
    return client


def _call(engine: Any, req: Any) -> dict[str, Any]:
    client = _client(engine)
    outs = engine.loop.run_until_complete(client.call(req))
    failed = [o for o in outs if o.status_code != 200]
    if failed:
        raise MorphControlError(failed[0].status_code, failed[0].body.get("error", ""))
    if client.replicas == 1 or getattr(req, "replica", None) is not None:
        (out,) = outs
        return out.body
    return {"replicas": [o.body for o in outs]}


def _check_replica(engine: Any, replica: int | None, required: bool) -> None:
    replicas = _client(engine).replicas
    if replica is None:
        if required and replicas > 1:
            raise ValueError(f"this engine has {replicas} data-parallel replicas and each swaps "
                             f"on its own: name one with replica= (0-{replicas - 1})")
    elif isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
        raise ValueError(f"replica must be a data-parallel replica index, 0-{replicas - 1}")


def status(engine: Any) -> dict[str, Any]:
    """Layer precisions, KV capacity and usage, the memory budget, recent transitions."""
    return _call(engine, MorphStatusReq())


def swap(engine: Any, layers: list[int], bits: int, pin: bool | None = None,
         replica: int | None = None) -> dict[str, Any]:
    """Serve ``layers`` at ``bits`` (16 restores) from the next batch on; the new status.
    ``pin`` and ``replica`` as in ``POST /morph/swap``."""
    layers = list(layers)
    if not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError("layers must be a non-empty list of layer indices")
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ValueError("bits must be an integer bit-width (16 restores)")
    if pin is not None and not isinstance(pin, bool):
        raise ValueError("pin must be True, False or None")
    _check_replica(engine, replica, required=True)
    return _call(engine, MorphSwapReq(layers=layers, bits=bits, pin=pin, replica=replica))


def set_mode(engine: Any, mode: str, replica: int | None = None) -> dict[str, Any]:
    """The controller's policy from now on (every replica's, or one's); the new status."""
    if not isinstance(mode, str):
        raise ValueError("mode must be a string: accuracy, default or performance")
    _check_replica(engine, replica, required=False)
    return _call(engine, MorphModeReq(mode=mode, replica=replica))
