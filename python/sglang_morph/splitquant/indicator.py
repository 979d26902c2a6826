"""Quality indicators: omega[layer, bits], the planner's estimate of what quantizing a layer costs.

- ``variance`` (SplitQuant / LLM-PQ, Theorem 1): round-to-nearest with step ``Delta`` adds
  independent noise of variance ``Delta^2 / 12`` to every weight, so a linear's output gains
  variance ``sum_o sum_i Delta[o, g(i)]^2 / 12 * E[x_i^2]``. ``Delta`` is the format's scale as
  built (W8: one per output row; W4: one per row and group, in AWQ's scaled domain, whose input
  is ``x / input_scale``), ``E[x_i^2]`` the diagonal of the calibration second moment that the
  AWQ search uses (``engines.awq``). Cheap: scales and one diagonal per linear.
- ``hessian``: ``lambda_max(G) * ||Q(W) - W||_F^2`` per linear, ``G = X^T X / n`` the same
  second moment (a bound on the output error ``trace(dW G dW^T)``); needs the dequantized
  variants and an eigenvalue per input group.
- ``random``: independent uniform values (W4 >= W8 per layer), the control.
- ``measured-kl``: no model of the error at all: the mean per-token KL(full precision ||
  quantized) of the float32 model's next-token distribution with layer l alone at b, on the
  calibration windows (``splitquant.measured``): one model run from layer l per (layer, bit-width).
  The expected NLL increase under the model's own distribution; the reference the others are
  judged by, and the most expensive.
- ``measured-nll``: from the same runs, the mean NLL increase of the calibration text itself
  (clipped at 0): it also sees the first-order effect of a layer's error on this kind of text,
  which KL (second order) cannot, at the price of sampling noise.
- ``variance-calibrated``: the variance indicator rescaled per format so that each format's
  total equals the measured KL of ALL layers at that format (two model runs): it keeps the
  variance indicator's ranking of layers within a format and fixes only how W8 compares with W4.

Every indicator is 0 at 16 bits. Statistics come from the train-split calibration text
(``data/text/wikitext2_train_head.txt``), never the test split.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.repo_data import WIKITEXT2_TRAIN_HEAD

INDICATORS = ("variance", "hessian", "random")
# computed from model runs on the calibration windows (``measured``)
MEASURED_INDICATORS = ("measured-kl", "measured-nll", "variance-calibrated")
CALIBRATION_TEXT = WIKITEXT2_TRAIN_HEAD


@dataclasses.dataclass(frozen=True)
class IndicatorResult:
    name: str
    bits: tuple[int, ...]
    omega: np.ndarray  # [layers, len(bits)]
    compute_s: float  # excluding the shared calibration pass


def calibration_stats(model_dir: Path, samples: int = 8, tokens_per_sample: int = 256,
                      seed: int = 0) -> tuple[list[dict], float]:
    """Per layer, per AWQ input group, the calibration input statistics; and the seconds taken."""
    from transformers import AutoModelForCausalLM

    from sglang_morph.engines import awq

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 local_files_only=True).eval()
    windows = calibration_windows(model_dir, samples, tokens_per_sample, seed)
    stats = list(awq.block_by_block_input_stats(model, windows, 4))
    return stats, time.perf_counter() - started


def calibration_windows(model_dir: Path, samples: int = 8, tokens_per_sample: int = 256,
                        seed: int = 0) -> torch.Tensor:
    """``[samples, tokens_per_sample]`` token ids drawn from the train-split calibration text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    # ~4 characters a token; 16x what is drawn leaves the windows spread without tokenizing
    # the whole file
    text = CALIBRATION_TEXT.read_text()[:64 * samples * tokens_per_sample]
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    n = ids.numel() // tokens_per_sample
    windows = ids[:n * tokens_per_sample].view(n, tokens_per_sample)
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:samples]
    return windows[chosen.sort().values]


def _group_of(linear: str) -> str:
    from sglang_morph.engines import awq

    for group in awq.INPUT_GROUPS:
        if linear in group.linears:
            return group.name
    raise KeyError(linear)


def _variance_of_linear(tensors: dict, bits: int, second_diag: torch.Tensor) -> float:
    scales = tensors["scales"].float()
    if bits == 8:  # per-row step: sum_o step_o^2 * sum_i E[x_i^2]
        return float((scales ** 2).sum() * second_diag.sum()) / 12.0
    x2 = second_diag
    if "input_scale" in tensors:  # the quantized weight sees x / input_scale
        x2 = x2 / tensors["input_scale"].float() ** 2
    n_groups = scales.shape[1]
    x2_per_group = x2.view(n_groups, -1).sum(dim=1)  # [groups]
    return float(((scales ** 2) @ x2_per_group).sum()) / 12.0


def compute(name: str, engines_dir: Path, stats: list[dict], bits: tuple[int, ...],
            model_dir: Path | None = None, seed: int = 0) -> IndicatorResult:
    """omega for ``bits`` (highest first; 16 gives 0) from the built variants in
    ``engines_dir`` and the calibration ``stats`` of ``calibration_stats``."""
    from sglang_morph.engines import formats
    from sglang_morph.engines.manifest import EngineManifest, read_variant

    if name not in INDICATORS:
        raise ValueError(f"unknown indicator {name!r}; choose from {INDICATORS} (measured ones: "
                         f"compute_measured)")
    manifest = EngineManifest.load(engines_dir)
    n_layers = manifest.num_layers
    started = time.perf_counter()
    omega = np.zeros((n_layers, len(bits)))
    if name == "random":
        rng = np.random.default_rng(seed)
        for k, b in enumerate(bits):
            if b != FULL_PRECISION_BITS:
                omega[:, k] = rng.uniform(size=n_layers)
        # a lower bit-width never looks better than a higher one of the same layer
        omega = np.maximum.accumulate(omega, axis=1)
        return IndicatorResult(name, bits, omega, time.perf_counter() - started)
    weights = None
    if name == "hessian":
        from safetensors import safe_open

        if model_dir is None:
            raise ValueError("the hessian indicator needs the model directory")
        weights = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                weights.update({k: f.get_tensor(k) for k in f.keys() if ".layers." in k})
    for layer in range(n_layers):
        layer_stats = stats[layer]
        lambda_max = {}
        if name == "hessian":
            lambda_max = {g: float(torch.linalg.eigvalsh(s.second_moment.double())[-1])
                          for g, s in layer_stats.items()}
        for k, b in enumerate(bits):
            if b == FULL_PRECISION_BITS:
                continue
            variant = read_variant(engines_dir, manifest.variant(layer, b))
            total = 0.0
            for linear, tensors in variant.items():
                group = _group_of(linear)
                if name == "variance":
                    diag = torch.diagonal(layer_stats[group].second_moment)
                    total += _variance_of_linear(tensors, b, diag)
                else:
                    w = weights[f"model.layers.{layer}.{linear}.weight"].float()
                    error = (formats.get_format(b).dequantize(tensors) - w).pow(2).sum()
                    total += lambda_max[group] * float(error)
            omega[layer, k] = total
    return IndicatorResult(name, bits, omega, time.perf_counter() - started)


def compute_measured(names: tuple[str, ...], engines_dir: Path, model_dir: Path,
                     windows: torch.Tensor, bits: tuple[int, ...],
                     variance: IndicatorResult | None = None,
                     probe=None) -> list[IndicatorResult]:
    """The ``MEASURED_INDICATORS`` in ``names``, from runs of the float32 model on ``windows``
    (calibration text). ``variance-calibrated`` rescales ``variance`` (same ``bits``); each
    result's ``compute_s`` includes loading the model and its full-precision pass. ``probe``:
    a ``measured.QualityProbe`` already built for these windows (then not counted)."""
    from sglang_morph.splitquant.measured import QualityProbe

    unknown = set(names) - set(MEASURED_INDICATORS)
    if unknown:
        raise ValueError(f"unknown measured indicators {sorted(unknown)}; choose from "
                         f"{MEASURED_INDICATORS}")
    started = time.perf_counter()
    quantized = tuple(b for b in bits if b != FULL_PRECISION_BITS)
    if probe is None:
        probe = QualityProbe(Path(model_dir), Path(engines_dir), windows, quantized)
    elif not torch.equal(probe.windows, windows):
        raise ValueError("the probe was built for other windows")
    shared_s = time.perf_counter() - started
    results = []
    if {"measured-kl", "measured-nll"} & set(names):
        started = time.perf_counter()
        kl, nll = np.zeros((probe.num_layers, len(bits))), np.zeros((probe.num_layers, len(bits)))
        from tqdm.auto import tqdm

        runs = [(k, b, layer) for k, b in enumerate(bits) if b != FULL_PRECISION_BITS
                for layer in range(probe.num_layers)]
        for k, b, layer in tqdm(runs, desc="measured omega", unit="run"):
            m = probe.measure({layer: b})
            kl[layer, k] = float(m["kl"].mean())
            nll[layer, k] = float((m["nll"] - probe.fp_nll).mean())
        # a measured decrease is the sample's noise or luck, not a gain to plan on
        nll = np.maximum(nll, 0.0)
        seconds = shared_s + time.perf_counter() - started
        results += [IndicatorResult(name, bits, omega, seconds) for name, omega
                    in (("measured-kl", kl), ("measured-nll", nll)) if name in names]
    if "variance-calibrated" in names:
        if variance is None or variance.name != "variance" or variance.bits != bits:
            raise ValueError("variance-calibrated needs the variance indicator for the same bits")
        started = time.perf_counter()
        omega = variance.omega.copy()
        for k, b in enumerate(bits):
            if b != FULL_PRECISION_BITS:
                kl_all = float(probe.measure({l: b for l in range(probe.num_layers)})["kl"].mean())
                omega[:, k] *= kl_all / omega[:, k].sum()
        results.append(IndicatorResult("variance-calibrated", bits, omega,
                                       variance.compute_s + shared_s
                                       + time.perf_counter() - started))
    return results


def save(path: Path, results: list[IndicatorResult], meta: dict) -> None:
    import json

    Path(path).write_text(json.dumps({**meta, "indicators": [
        {"name": r.name, "bits": list(r.bits), "compute_s": r.compute_s,
         "omega": r.omega.tolist()} for r in results]}, indent=1))


def load(path: Path, name: str) -> IndicatorResult:
    import json

    raw = json.loads(Path(path).read_text())
    for r in raw["indicators"]:
        if r["name"] == name:
            return IndicatorResult(name, tuple(r["bits"]), np.array(r["omega"]), r["compute_s"])
    raise ValueError(f"{path} has no {name!r} indicator; it has "
                     f"{[r['name'] for r in raw['indicators']]}")
