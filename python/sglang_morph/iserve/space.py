"""The configuration space iServe chooses from, what of it is servable here, and how to serve it.

A configuration is (weight bits, tensor-parallel size, pipeline-parallel size); iServe's space
is {16, 8, 4} x {TP 1, 3} x {PP 1, 2, 3} (TP 3: the default model has 9 query / 3 KV heads, so
SGLang shards it over 1 or 3 ranks only). What serves each one:

- 16 bits: plain SGLang, any TP x PP (no ``--enable-morph``; nothing of ours is on the path but
  the CPU fixes in ``parallel/``).
- 8 and 4 bits: ``--enable-morph --morph-precision-map '*:B'`` with the controller off, under one
  layout at a time: TP alone or PP alone. The plugin refuses TP with PP (layer swaps and KV
  resizing run per rank or per stage, not both), so W8/W4 x TP 3 x PP 2/3 is excluded here with
  that reason rather than estimated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.repo_data import REPO_ROOT

SERVE_SH = REPO_ROOT / "scripts" / "serve.sh"
BITS = (16, 8, 4)
TP_SIZES = (1, 3)
PP_SIZES = (1, 2, 3)


@dataclasses.dataclass(frozen=True, order=True)
class Configuration:
    bits: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        if self.bits not in BITS or self.tp < 1 or self.pp < 1:
            raise ValueError(f"bad configuration {self}")

    @property
    def processes(self) -> int:
        """Scheduler processes (ranks): what holds weights and KV."""
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"W{self.bits}-TP{self.tp}-PP{self.pp}"

    @classmethod
    def parse(cls, text: str) -> "Configuration":
        """``W8-TP1-PP2`` (the ``name`` form)."""
        try:
            w, t, p = text.strip().upper().split("-")
            if not (w.startswith("W") and t.startswith("TP") and p.startswith("PP")):
                raise ValueError
            return cls(int(w[1:]), int(t[2:]), int(p[2:]))
        except ValueError:
            raise ValueError(f"bad configuration {text!r}: expected e.g. W8-TP1-PP2") from None


def space(bits=BITS, tp_sizes=TP_SIZES, pp_sizes=PP_SIZES) -> tuple[Configuration, ...]:
    return tuple(Configuration(b, t, p) for b in bits for t in tp_sizes for p in pp_sizes)


def exclusion_reason(cfg: Configuration, hf_config: dict) -> str | None:
    """Why ``cfg`` cannot be served for the model of ``hf_config`` here, or None."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)
    layers = hf_config["num_hidden_layers"]
    if heads % cfg.tp or (kv_heads % cfg.tp and cfg.tp % kv_heads):
        return (f"TP {cfg.tp} does not split {heads} query / {kv_heads} KV heads evenly "
                f"(SGLang would pad them on CPU; the W8/W4 variants have no padded rows)")
    if cfg.pp > layers:
        return f"PP {cfg.pp} needs at least one of the {layers} layers per stage"
    if cfg.bits != FULL_PRECISION_BITS and cfg.tp > 1 and cfg.pp > 1:
        return ("--enable-morph refuses --tp-size with --pp-size (layer variants are served "
                "per rank or per stage, one layout at a time); 16-bit TP x PP is plain SGLang")
    return None


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """SGLang's default partition (``get_pp_indices``): even, the last ``num_layers % pp``
    stages one layer more."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if rank >= pp - extra else 0) for rank in range(pp))


def serve_argv(cfg: Configuration, model_dir: Path | None, engines_dir: Path | None,
               kv_tokens: int, max_running_requests: int | None = None,
               extra: tuple[str, ...] = ()) -> list[str]:
    """``scripts/serve.sh`` arguments serving ``cfg``: the same flags for a fingerprint and for
    the full model, so what was profiled is what is launched."""
    argv = [str(SERVE_SH)]
    if model_dir is not None:
        argv += ["--model-path", str(model_dir)]
    if cfg.tp > 1:
        argv += ["--tp-size", str(cfg.tp)]
    if cfg.pp > 1:
        argv += ["--pp-size", str(cfg.pp)]
    if cfg.bits != FULL_PRECISION_BITS:
        if engines_dir is None:
            raise ValueError(f"{cfg.name} needs an engines directory with {cfg.bits}-bit variants")
        argv += ["--enable-morph", "--morph-engines", str(engines_dir),
                 "--morph-precision-map", f"*:{cfg.bits}", "--disable-morph-controller"]
    # Every rank (stage) gets a pool of this many tokens; fixed so that KV bytes per layer are
    # the same in the fingerprints and the full model.
    argv += ["--max-total-tokens", str(kv_tokens)]
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
        if cfg.pp > 1:
            # One micro-batch holds every running request. SGLang's default cap is
            # max_running_requests // pp: at 4 requests a PP 3 server ran micro-batches of one
            # and held the fourth request back (TPOT 2.3x PP 2's in the profile of 275a433),
            # which no stage-and-hop line models; a whole batch per micro-batch is what L2's
            # pipeline line (and iserve_sim's) describes.
            argv += ["--pp-max-micro-batch-size", str(max_running_requests)]
    return argv + list(extra)
