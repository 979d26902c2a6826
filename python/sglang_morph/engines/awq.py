"""Activation-aware scale search for the W4 format (AWQ, Lin et al., MLSys 2024).

AWQ protects the input channels that carry large activations: a weight is quantized as
``W * s`` (one factor per input channel) and the activation is divided by ``s`` at run time,
with ``s = mean|x| ** alpha``. ``alpha`` is grid-searched per *input-sharing group* of linears
(the linears that read the same activation) to minimize the group's output error on
calibration activations of the full-precision model. Then, as AWQ's auto-clip, each W4 group's
range may be shrunk (clip ratio per output row and group) where that lowers the output error:
the extremes of a group cost resolution to every other weight in it.

Why second moments instead of stored activations: for a linear with weight error
``dW = W - W_eff`` and calibration inputs ``X`` (n tokens), the mean over tokens of
``||X dW^T||^2`` equals ``trace(dW G dW^T)`` with ``G = X^T X / n``. So the calibration pass
keeps, per group, only ``G`` ([in, in]) and mean|x| ([in]), whatever the number of tokens, and
each candidate costs one [out, in] x [in, in] product instead of a pass over all tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

from sglang_morph.engines import formats

W4 = formats.get_format(4)
# mean|x| is raised to alpha and normalized by sqrt(max * min): a channel that never fires would
# make that product 0; this floor keeps the normalization finite.
MEAN_ABS_FLOOR = 1e-6


@dataclasses.dataclass(frozen=True)
class InputGroup:
    """Linears that read the same activation; ``linears[0]`` is where that input is observed.

    They get ONE shared ``input_scale``: the SGLang installer fuses q/k/v and gate/up into single
    linears whose activation can only be divided by one vector.
    """

    name: str
    linears: tuple[str, ...]


# Inputs: input_layernorm output; attention output; post_attention_layernorm output; act(gate) * up.
INPUT_GROUPS = (
    InputGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    InputGroup("o", ("self_attn.o_proj",)),
    InputGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    InputGroup("down", ("mlp.down_proj",)),
)


@dataclasses.dataclass(frozen=True)
class InputStats:
    """One group's input over the calibration tokens."""

    mean_abs: torch.Tensor  # [in] float32: mean over tokens of |x|
    second_moment: torch.Tensor  # [in, in] float32: X^T X / n_tokens
    n_tokens: int


class _InputStatsAccumulator:
    def __init__(self) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.gram: torch.Tensor | None = None
        self.n_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        # Each batch's product is float32 (fast); the running sums are float64 so that many
        # batches do not lose the small channels.
        abs_sum = x.abs().sum(dim=0).double()
        gram = (x.T @ x).double()
        if self.gram is None:
            self.abs_sum, self.gram = abs_sum, gram
        else:
            self.abs_sum += abs_sum
            self.gram += gram
        self.n_tokens += x.shape[0]

    def result(self) -> InputStats:
        if self.gram is None:
            raise RuntimeError("no calibration input was observed")
        return InputStats(
            mean_abs=(self.abs_sum / self.n_tokens).float(),
            second_moment=(self.gram / self.n_tokens).float(),
            n_tokens=self.n_tokens,
        )


def collect_input_stats(
    layer: torch.nn.Module, run_layer: Callable[[], None]
) -> dict[str, InputStats]:
    """Per group name, the statistics of the group's input while ``run_layer`` runs ``layer``."""
    accumulators = {g.name: _InputStatsAccumulator() for g in INPUT_GROUPS}
    handles = [
        layer.get_submodule(g.linears[0]).register_forward_pre_hook(
            lambda _module, args, acc=accumulators[g.name]: acc.add(args[0])
        )
        for g in INPUT_GROUPS
    ]
    try:
        run_layer()
    finally:
        for handle in handles:
            handle.remove()
    return {name: acc.result() for name, acc in accumulators.items()}


class _FirstLayerReached(Exception):
    """Stops the model's forward once the first decoder layer's inputs are captured."""


def block_by_block_input_stats(
    model: torch.nn.Module, windows: torch.Tensor, batch_sequences: int
) -> Iterator[dict[str, InputStats]]:
    """For each decoder layer of an HF Llama-style ``model`` in order, its groups' input stats.

    The model runs block by block: the calibration hidden states go through one layer at a time
    and each layer's full-precision output is the next layer's input, as in AWQ. So only one
    layer's statistics and one set of hidden states are alive at a time, whatever the model size.
    ``windows``: [samples, tokens] token ids, run ``batch_sequences`` at a time.
    """
    layers = model.model.layers
    batches: list[tuple[torch.Tensor, dict]] = []

    def capture(_module, args, kwargs):
        # The keyword arguments (rotary embeddings, causal mask, positions) are what the model
        # computed for this batch; every layer takes the same ones.
        hidden = args[0] if args else kwargs.pop("hidden_states")
        batches.append((hidden, kwargs))
        raise _FirstLayerReached

    handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.inference_mode():
            for batch in windows.split(batch_sequences):
                try:
                    model.model(input_ids=batch, use_cache=False)
                except _FirstLayerReached:
                    pass
    finally:
        handle.remove()

    for layer in layers:
        outputs = []

        def run_layer(layer=layer, outputs=outputs) -> None:
            with torch.inference_mode():
                outputs.extend(layer(hidden, **kwargs) for hidden, kwargs in batches)

        yield collect_input_stats(layer, run_layer)
        batches = [(out, kwargs) for out, (_, kwargs) in zip(outputs, batches)]


def output_error(weight: torch.Tensor, w_eff: torch.Tensor, stats: InputStats) -> float:
    """Sum over output features of the mean over calibration tokens of the squared output error."""
    delta = weight.float() - w_eff
    return float(((delta @ stats.second_moment) * delta).sum())


def alpha_grid(grid_size: int) -> tuple[float, ...]:
    """``grid_size`` points in [0, 1), starting at 0 (s = 1, plain round-to-nearest)."""
    if grid_size < 1:
        raise ValueError(f"the alpha grid needs at least one point, got {grid_size}")
    return tuple(i / grid_size for i in range(grid_size))


def awq_input_scale(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = mean|x| ** alpha`` normalized by sqrt(max * min), in the stored dtype.

    The normalization centers s around 1 (in log scale) so that ``W * s`` stays in a range where
    bf16 scales are precise; alpha = 0 gives exactly 1 everywhere.
    """
    s = mean_abs.float().clamp(min=MEAN_ABS_FLOOR).pow(alpha)
    s = s / (s.max() * s.min()).sqrt()
    return s.to(formats.SCALE_DTYPE)


def clip_ratio_grid(grid_size: int) -> tuple[float, ...]:
    """``grid_size`` ratios from 1 (no clipping) down in steps of 0.05, as AWQ's auto-clip."""
    if not 1 <= grid_size <= 10:
        raise ValueError(f"the clip grid needs 1 to 10 ratios (down to 0.55), got {grid_size}")
    return tuple(1.0 - i / 20 for i in range(grid_size))


def _clip_to_ratio(weight: torch.Tensor, input_scale: torch.Tensor, group_size: int,
                   ratio: torch.Tensor) -> torch.Tensor:
    """``weight`` with every W4 group of ``weight * input_scale`` clamped to ``ratio`` times its

    range (``ratio``: [out, groups]). ``formats`` takes the group's min and max as its grid, so
    handing it the clamped weight is the same as clipping the grid there.
    """
    s = input_scale.float()[None, :]
    out_features, in_features = weight.shape
    groups = (weight.float() * s).view(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1).clamp(max=0.0) * ratio
    high = groups.amax(dim=-1).clamp(min=0.0) * ratio
    clipped = torch.maximum(torch.minimum(groups, high[..., None]), low[..., None])
    return clipped.view(out_features, in_features) / s


def _search_clip(weight: torch.Tensor, unclipped: formats.Tensors, input_scale: torch.Tensor,
                 group_size: int, stats: InputStats, clip_grid_size: int) -> formats.Tensors:
    """Per (output row, W4 group), the clip ratio with the least output error of that group.

    Each (row, group) is scored on its own input channels only (the diagonal block of the second
    moment), as AWQ's auto-clip does: that makes the choices independent, so one pass over the
    ratios picks all of them. ``unclipped`` is ratio 1, already quantized by the scale search.
    """
    out_features, in_features = weight.shape
    n_groups = in_features // group_size
    m = stats.second_moment
    diagonal_blocks = torch.stack([
        m[j * group_size:(j + 1) * group_size, j * group_size:(j + 1) * group_size]
        for j in range(n_groups)
    ])

    def block_errors(quantized: formats.Tensors) -> torch.Tensor:
        delta = (weight.float() - W4.dequantize(quantized)).view(out_features, n_groups, group_size)
        return torch.einsum("ong,ngh,onh->on", delta, diagonal_blocks, delta)

    best_error = block_errors(unclipped)
    best_ratio = torch.ones(out_features, n_groups)
    for ratio in clip_ratio_grid(clip_grid_size)[1:]:
        ratios = torch.full((out_features, n_groups), ratio)
        error = block_errors(W4.quantize(
            _clip_to_ratio(weight, input_scale, group_size, ratios),
            group_size=group_size, input_scale=input_scale))
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_ratio = torch.where(better, ratios, best_ratio)
    return W4.quantize(_clip_to_ratio(weight, input_scale, group_size, best_ratio),
                       group_size=group_size, input_scale=input_scale)


@dataclasses.dataclass(frozen=True)
class GroupSearchResult:
    """The outcome for one input-sharing group; ``quantized`` are its formats.w4 tensors.

    MSEs are means over calibration tokens and over the group's output features.
    Invariant: output_mse <= scaled_output_mse <= rtn_output_mse.
    """

    alpha: float
    input_scale: torch.Tensor  # [in] bf16, the same tensor in every linear of the group
    quantized: dict[str, formats.Tensors]
    output_mse: float  # after the scale and the clip search
    scaled_output_mse: float  # at the chosen alpha, before clipping
    rtn_output_mse: float  # alpha = 0 without clipping, i.e. plain round-to-nearest
    clipped_linears: tuple[str, ...]  # linears where clipping lowered the error


def search_group(
    weights: dict[str, torch.Tensor],
    stats: InputStats,
    group_sizes: dict[str, int],
    alpha_grid_size: int,
    clip_grid_size: int,
) -> GroupSearchResult:
    """AWQ for one input-sharing group (``weights``: linear name -> [out, in] float).

    First alpha (shared by the group), then per linear the clip ratios at that alpha. Every
    error is measured on ``W4.dequantize``, i.e. exactly the weight the kernels compute with,
    and each step keeps its starting point among the candidates (alpha = 0, ratio 1), so the
    result is never worse than round-to-nearest on the calibration objective.
    """
    out_features_total = sum(w.shape[0] for w in weights.values())

    def errors(quantized: dict[str, formats.Tensors]) -> dict[str, float]:
        return {name: output_error(w, W4.dequantize(quantized[name]), stats)
                for name, w in weights.items()}

    best = None  # (mse, alpha, input_scale, quantized, per-linear errors)
    rtn_mse = None
    for alpha in alpha_grid(alpha_grid_size):
        input_scale = awq_input_scale(stats.mean_abs, alpha)
        quantized = {
            name: W4.quantize(w, group_size=group_sizes[name], input_scale=input_scale)
            for name, w in weights.items()
        }
        linear_errors = errors(quantized)
        mse = sum(linear_errors.values()) / out_features_total
        rtn_mse = mse if rtn_mse is None else rtn_mse
        if best is None or mse < best[0]:
            best = (mse, alpha, input_scale, quantized, linear_errors)
    scaled_mse, alpha, input_scale, quantized, linear_errors = best

    if clip_grid_size == 1:  # ratio 1 only: nothing to clip
        return GroupSearchResult(alpha, input_scale, quantized, scaled_mse, scaled_mse, rtn_mse, ())
    # Each linear's output error is its own, so keeping clipping per linear only where it helps
    # keeps the group's error at or below the scale search's.
    clipped = {
        name: _search_clip(
            w, quantized[name], input_scale, group_sizes[name], stats, clip_grid_size
        )
        for name, w in weights.items()
    }
    clipped_errors = errors(clipped)
    clipped_linears = tuple(n for n in weights if clipped_errors[n] < linear_errors[n])
    for name in clipped_linears:
        quantized[name], linear_errors[name] = clipped[name], clipped_errors[name]
    return GroupSearchResult(
        alpha=alpha,
        input_scale=input_scale,
        quantized=quantized,
        output_mse=sum(linear_errors.values()) / out_features_total,
        scaled_output_mse=scaled_mse,
        rtn_output_mse=rtn_mse,
        clipped_linears=clipped_linears,
    )
