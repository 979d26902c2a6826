"""MorphServe under SGLang's tensor parallelism (``--enable-morph --tp-size N``).

**Each rank holds its shard of every variant, sharded at load.** The engines directory holds
whole-layer variants (one per layer and bit-width, the same files a one-rank server reads).
Each TP rank reads and verifies them (sha256) and keeps only its shard, cut the way SGLang's
``weight_loader`` cuts the full-precision weights of the same linear, with the sizes and ranks
read off the served model's own linears:

- ``qkv_proj`` (QKVParallelLinear): this rank's q heads, then its k and v heads (a KV head
  serves ``num_kv_head_replicas`` ranks when there are fewer KV heads than ranks);
- ``gate_up_proj`` (MergedColumnParallelLinear): this rank's slice of gate, then of up;
- ``o_proj`` and ``down_proj`` (RowParallelLinear): this rank's slice of the input columns.

Output rows carry their own scales (W8 per output channel, W4 per row and group), so a
column-parallel shard takes the rows and their scales; a row-parallel shard takes input
columns, W8's per-channel scales whole, and W4's scales and zeros of the groups it holds, so
the shard must hold whole groups (checked at launch: the group size must divide
``in_features / N``). AWQ's ``input_scale`` follows the input: whole for column-parallel
linears, sliced for row-parallel ones.

**Every rank swaps the same layers at the same step.** Only TP rank 0 receives requests from
the TokenizerManager; SGLang broadcasts every step's requests (ours included) to the other
ranks (``recv_requests``), and each rank's dispatcher handles them in the same order before
scheduling, so all ranks apply each ``/morph`` request at the same point of their (replicated)
schedule. Equal shards make the per-rank weight deltas and KV bytes per token equal, so the
KV pool grows by the same tokens on every rank; the ranks check that at startup (a gloo
exchange over SGLang's TP CPU group, refusing to start otherwise) and after each request, when
every rank reports its outcome to rank 0, whose answer alone reaches the TokenizerManager
(the others have no socket) and lists every rank (``tp_ranks``). A rank that disagrees turns
the answer into a 500 that says so.

**One controller decides** (``parallel/relay.py``). Each rank's controller would decide from
its own clock and samples, so only TP rank 0's decides. Its action (``MorphActionReq``) joins
the inputs rank 0 broadcasts at the next step, the way SGLang's own rank-0 decisions do (the
timeout aborts of ``Scheduler._poll_timeout_aborts``, which ride the same broadcast; the plugin
hooks that method), so every rank's dispatcher applies it at that step, like a
``/morph/swap``. Rank 0 decides nothing more until its action has come back through the
broadcast.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from sglang_morph.morph.config import MorphConfig, MorphConfigError

logger = logging.getLogger("sglang_morph")

Tensors = dict[str, torch.Tensor]
# Row-parallel linears of a Llama decoder layer: HF name -> what its input dimension is.
_ROW_PARALLEL = {"self_attn.o_proj": "num_attention_heads x head_dim",
                 "mlp.down_proj": "intermediate_size"}


# ----- launcher ----------------------------------------------------------------------------------

def check_launch(server_args: Any, cfg: MorphConfig, hf_config: dict[str, Any] | None,
                 manifest: Any) -> None:
    """Refuse, with one line, a ``--tp-size`` launch the sharded variants cannot serve."""
    tp = getattr(server_args, "tp_size", 1) or 1
    if tp <= 1:
        return
    # (--tp-size with --pp-size or --dp-size: refused by plugin.check_supported, called first)
    if hf_config is None:
        return
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)
    inter = hf_config["intermediate_size"]
    if heads % tp or inter % tp or (kv_heads % tp and tp % kv_heads):
        # SGLang pads unaligned shards on CPU; whole-layer variants have no padded rows.
        raise MorphConfigError(
            f"--enable-morph --tp-size {tp} needs num_attention_heads ({heads}) and "
            f"intermediate_size ({inter}) divisible by {tp}, and num_key_value_heads "
            f"({kv_heads}) a multiple or a divisor of {tp}")
    if manifest is None:
        return
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    in_features = {"self_attn.o_proj": heads * head_dim, "mlp.down_proj": inter}
    for i in range(manifest.num_layers):
        for bits in manifest.bits_available:
            groups = manifest.variant(i, bits).group_sizes or {}
            for name, what in _ROW_PARALLEL.items():
                g = groups.get(name)
                if g is not None and (in_features[name] // tp) % g:
                    raise MorphConfigError(
                        f"--enable-morph --tp-size {tp}: the W{bits} variant of layer {i} "
                        f"{name} has groups of {g} input columns, which do not divide a rank's "
                        f"{in_features[name] // tp} columns ({what} {in_features[name]} / "
                        f"{tp}); rebuild the engines with a group size that does")


def initial_kv_tokens(cfg: MorphConfig, hf_config: dict[str, Any], server_args: Any) -> int:
    """The launcher's ``--max-total-tokens`` under TP with ``--morph-memory-budget`` (a budget
    per rank): an upper bound, the budget less a rank's share of the checkpoint's weights over
    a rank's KV bytes per token. Each rank's runtime trims its still empty pool to what its
    budget holds with the weights it really has (replicated norms, its vocabulary shard)."""
    from pathlib import Path

    from sglang_morph.morph.startup import checkpoint_weight_bytes, _dtype_bytes

    tp = server_args.tp_size
    model_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    dtype = model_dtype if server_args.dtype == "auto" else server_args.dtype
    kv_dtype = dtype if server_args.kv_cache_dtype in ("auto", None) else server_args.kv_cache_dtype
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    kv_per_token = (2 * hf_config["num_hidden_layers"] * max(1, kv_heads // tp) * head_dim
                    * _dtype_bytes(kv_dtype, "the KV cache"))
    weights = checkpoint_weight_bytes(Path(server_args.model_path).expanduser(), hf_config,
                                      _dtype_bytes(dtype, "weights"))
    tokens = (cfg.memory_budget_bytes - weights // tp) // kv_per_token
    if tokens < 256:
        raise MorphConfigError(
            f"--morph-memory-budget {cfg.memory_budget_bytes} bytes (per tensor-parallel rank) "
            f"is too small: a rank's share of the weights is about {weights // tp} bytes, "
            f"leaving room for {max(tokens, 0)} KV tokens ({kv_per_token} bytes each)")
    return tokens


# ----- model load: sharding the variants ---------------------------------------------------------

def _rank_size(group: Any) -> tuple[int, int]:
    # (as SGLang's linears read their group: None is an unsharded layout)
    return (0, 1) if group is None else (group.rank_in_group, group.world_size)


def _rows(t: Tensors, start: int, size: int) -> Tensors:
    """Output rows ``start..start+size`` (and their scales and zeros); ``input_scale`` whole."""
    out = {}
    for name, x in t.items():
        if name != "input_scale":
            if start + size > x.shape[0]:
                raise ValueError(f"rows {start}-{start + size} of a {x.shape[0]}-row variant")
            x = x[start:start + size]
        out[name] = x.contiguous()
    return out


def _columns(t: Tensors, start: int, size: int, in_features: int) -> Tensors:
    """Input columns ``start..start+size``: packed weight columns, W4's scales and zeros of the
    groups they make up, ``input_scale``'s entries; W8's per-output-channel scales whole."""
    out = {}
    for name, x in t.items():
        if name == "input_scale":
            x = x[start:start + size]
        elif x.dim() == 2:  # qweight (f columns per stored one), W4 scales / zeros (one a group)
            per = in_features // x.shape[1]
            if start % per or size % per:
                raise ValueError(f"{name}: a shard of {size} input columns at {start} splits "
                                 f"a group of {per}")
            x = x[:, start // per:(start + size) // per]
        out[name] = x.contiguous()
    return out


def sharder(model: torch.nn.Module) -> Callable[[int, dict[str, Tensors]], dict[str, Tensors]] | None:
    """A function cutting one layer's whole variant (tensors per HF linear) to this rank's
    shard, as SGLang cut the full-precision weights of the same linears; None on one rank."""
    layers = model.model.layers
    first = next((layer for layer in layers if hasattr(layer, "self_attn")), None)
    if first is None or _rank_size(first.self_attn.qkv_proj.tp_group)[1] <= 1:
        return None

    def shard(layer_index: int, by_linear: dict[str, Tensors]) -> dict[str, Tensors]:
        layer = layers[layer_index]
        qkv = layer.self_attn.qkv_proj
        rank, _ = _rank_size(qkv.tp_group)
        kv_rank, _ = _rank_size(getattr(qkv, "kv_tp_group", qkv.tp_group))
        kv_shard = kv_rank // qkv.num_kv_head_replicas
        q, k, v = (qkv.num_heads * qkv.head_size, qkv.num_kv_heads * qkv.head_size,
                   qkv.num_kv_heads * qkv.v_head_size)
        out = {"self_attn.q_proj": _rows(by_linear["self_attn.q_proj"], rank * q, q),
               "self_attn.k_proj": _rows(by_linear["self_attn.k_proj"], kv_shard * k, k),
               "self_attn.v_proj": _rows(by_linear["self_attn.v_proj"], kv_shard * v, v)}
        gate_up = layer.mlp.gate_up_proj
        rank, tp = _rank_size(gate_up.tp_group)
        for name, full in zip(("mlp.gate_proj", "mlp.up_proj"), gate_up.output_sizes):
            out[name] = _rows(by_linear[name], rank * (full // tp), full // tp)
        for name in _ROW_PARALLEL:
            linear = layer.get_submodule(name)
            rank, tp = _rank_size(linear.tp_group)
            size = linear.input_size_per_partition
            out[name] = _columns(by_linear[name], rank * size, size, size * tp)
        return out

    return shard


def sharding_note(model: torch.nn.Module) -> str:
    """How this rank's variants were made (``/morph/status``, the startup log)."""
    rank, tp = _rank_size(model.model.layers[0].self_attn.qkv_proj.tp_group)
    if tp <= 1:
        return "whole layers (one rank)"
    return (f"sharded at load from the whole-layer variants: tp rank {rank} of {tp} holds its "
            f"q/k/v heads and gate/up rows (column-parallel) and its o_proj/down_proj input "
            f"columns (row-parallel), as SGLang's weight_loader shards the full-precision weights")


# ----- scheduler: the ranks agree ----------------------------------------------------------------

class TensorParallelRanks:
    """This scheduler's place among the TP ranks of one model.

    Invariant: after startup and after every ``/morph`` request, every rank has the same layer
    bits, KV capacity, KV bytes per token and budget figures (they hold equal shards and apply
    the same requests at the same step); ``agree`` refuses to start and ``gather`` answers 500
    when they do not.
    """

    def __init__(self, runtime: Any, group: Any):
        self.runtime = runtime
        self.group = group  # SGLang's TP group (its gloo cpu_group carries our exchanges)
        self.rank, self.size = group.rank_in_group, group.world_size
        self.note = sharding_note(runtime.model)

    @classmethod
    def of(cls, runtime: Any) -> "TensorParallelRanks | None":
        group = getattr(runtime.scheduler, "tp_group", None)
        if group is None or group.world_size <= 1:
            return None
        return cls(runtime, group)

    def _all(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group.cpu_group)
        return out

    def _summary(self) -> dict[str, Any]:
        rt = self.runtime
        return {"layer_bits": list(rt.layer_bits),
                "kv_capacity_tokens": rt.resizer.capacity_tokens,
                "kv_bytes_per_token": rt.kv_bytes_per_token,
                "memory_budget_bytes": rt.budget.total_bytes,
                "weight_bytes": rt.budget.weight_bytes, "kv_bytes": rt.budget.kv_bytes,
                "free_budget_bytes": rt.budget.free_bytes}

    def agree(self) -> None:
        """Startup (every rank builds its runtime before serving, so a blocking exchange is
        safe): equal shards, equal pools. Raises RuntimeError naming what differs."""
        rt = self.runtime
        staged = rt.installer.staged if rt.installer is not None else None
        shapes = sorted(staged.shard_shapes.items()) if staged is not None else []
        full = ([rt.installer.full_precision_bytes(i) for i in range(rt.num_layers)]
                if rt.installer is not None else [])
        mine = (self._summary(), shapes, full)
        ranks = self._all(mine)
        for what, k in (("budget, weights or KV pool", 0), ("variant shard shapes", 1),
                        ("full-precision layer bytes", 2)):
            if any(r[k] != ranks[0][k] for r in ranks):
                raise RuntimeError(
                    f"tensor-parallel ranks hold different {what} ({[r[k] for r in ranks]}); "
                    f"layer swaps would grow their KV pools differently")
        logger.info("sglang-morph: tp rank %d of %d: %s; every rank has KV capacity %d tokens, "
                    "%d bytes per token", self.rank, self.size, self.note,
                    rt.resizer.capacity_tokens, rt.kv_bytes_per_token)

    def gather(self, output: Any) -> Any:
        """After a ``/morph`` request (every rank handles it at the same point): every rank's
        outcome to all; rank 0's answer (the only one that reaches the TokenizerManager) lists
        them and becomes a 500 if they disagree."""
        mine = {"tp_rank": self.rank, "status_code": output.status_code, **self._summary()}
        ranks = self._all(mine)
        if self.rank != 0:
            return output
        output.body["tp_ranks"] = ranks
        same = [{k: v for k, v in r.items() if k != "tp_rank"} for r in ranks]
        if any(r != same[0] for r in same):
            logger.critical("sglang-morph: tensor-parallel ranks disagree after %s: %s",
                            type(output).__name__, ranks)
            output.status_code = 500
            output.body["error"] = ("tensor-parallel ranks disagree after this request (see "
                                    "tp_ranks); restart the server")
        return output

    def status(self) -> dict[str, Any]:
        return {"tp_size": self.size, "tp_rank": self.rank, "variant_shards": self.note,
                "controller": "rank 0 decides; its actions reach every rank through SGLang's "
                              "broadcast of the scheduler inputs"}

