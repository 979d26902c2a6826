"""What quantizing layers really costs: per-token NLL and KL(full precision || quantized) of
fixed token windows with a precision map applied to the float32 model (the built variants'
dequantized weights, ``engines.hf_variants``). The indicators' calibration
(``splitquant.indicator.calibrate``) and ``benchmark.splitquant.quality`` measure with it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sglang_morph.engines.hf_variants import (LayerRunner, LayerVariants, first_windows,
                                              load_model, load_tokenizer, open_engines,
                                              read_token_ids, sampled_windows)
from sglang_morph.repo_data import WIKITEXT2_TEST, WIKITEXT2_TRAIN_HEAD

SPLITS = {"train": WIKITEXT2_TRAIN_HEAD, "test": WIKITEXT2_TEST}


class QualityProbe:
    """Per-token NLL and KL(full precision || config) of fixed windows, for precision maps.

    Full-precision hidden states at every layer input are computed once; a map whose first
    quantized layer is ``m`` reruns layers ``m ..`` only. The full-precision log-probabilities
    are kept too when they are small (``CACHE_LOGPROB_ELEMENTS``), else recomputed per map.
    """

    CACHE_LOGPROB_ELEMENTS = 2**28  # 1 GiB of float32

    def __init__(self, model_dir: Path, engines_dir: Path, windows: torch.Tensor,
                 bits: tuple[int, ...] = (8, 4)):
        self.model = load_model(model_dir)
        self.runner = LayerRunner(self.model, windows)
        self.windows = windows
        self.variants = {b: LayerVariants(self.model, engines_dir,
                                          open_engines(engines_dir, model_dir, b), b,
                                          progress=False) for b in bits}
        self.num_layers = self.runner.num_layers
        self.fp_inputs = self.runner.layer_inputs()
        vocab = self.model.lm_head.weight.shape[0]
        cache = windows.shape[0] * (windows.shape[1] - 1) * vocab <= self.CACHE_LOGPROB_ELEMENTS
        self._fp_logp = [self._log_probs(self.fp_inputs[-1], row)
                         for row in range(windows.shape[0])] if cache else None
        self.fp_nll = self._token_nll(self.fp_inputs[-1], with_kl=False)[0]

    def _set(self, layer_bits: dict[int, int]) -> None:
        for b, v in self.variants.items():
            v.set_quantized([l for l, lb in layer_bits.items() if lb == b])

    @torch.inference_mode()
    def _log_probs(self, hidden: torch.Tensor, row: int) -> torch.Tensor:
        return F.log_softmax(self.model.lm_head(self.runner.final_norm(hidden[row, :-1])), dim=-1)

    @torch.inference_mode()
    def _token_nll(self, hidden: torch.Tensor, with_kl: bool = True
                   ) -> tuple[np.ndarray, np.ndarray | None]:
        """[windows, tokens-1] NLL (nats) and KL(full precision || this)."""
        nll, kl = [], []
        for row in range(hidden.shape[0]):
            logp = self._log_probs(hidden, row)
            target = self.windows[row, 1:]
            nll.append(-logp.gather(1, target[:, None])[:, 0].double().numpy())
            if with_kl:
                logp_fp = (self._fp_logp[row] if self._fp_logp is not None
                           else self._log_probs(self.fp_inputs[-1], row))
                kl.append((logp_fp.exp() * (logp_fp - logp)).sum(-1).double().numpy())
        return np.stack(nll), (np.stack(kl) if with_kl else None)

    def measure(self, layer_bits: dict[int, int]) -> dict:
        """NLL [windows, tokens-1] and KL [windows, tokens-1] with ``layer_bits`` quantized."""
        quantized = {l: b for l, b in layer_bits.items() if b != 16}
        if not quantized:
            return {"nll": self.fp_nll, "kl": np.zeros_like(self.fp_nll)}
        start = min(quantized)
        self._set(quantized)
        try:
            hidden = self.runner.run(self.fp_inputs[start], start)
            nll, kl = self._token_nll(hidden)
        finally:
            self._set({})
        return {"nll": nll, "kl": kl}


def window_mean_se(per_token: np.ndarray) -> tuple[float, float]:
    """Mean over tokens and its standard error with windows as the independent units."""
    per_window = per_token.mean(axis=1)
    n = len(per_window)
    se = float(per_window.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return float(per_token.mean()), se


def make_windows(model_dir: Path, split: str, windows: int, window_tokens: int,
                 seed: int = 0) -> torch.Tensor:
    """``windows`` x ``window_tokens`` token ids: drawn across the TRAIN head with ``seed``
    (calibration, as AWQ's), or the first ones of the test split (the perplexity benchmark's)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {tuple(SPLITS)}")
    ids = read_token_ids(load_tokenizer(model_dir), SPLITS[split])
    if split == "train":
        return sampled_windows(ids, windows, window_tokens, seed)
    return first_windows(ids, windows, window_tokens)
