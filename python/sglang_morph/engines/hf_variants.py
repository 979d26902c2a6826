"""Built layer variants inside a plain transformers model: the offline tools' view of the engines.

The layer profile (``sglang_morph.morph.profile_layers``) and the quality benchmarks need "the model
with layers Q quantized" thousands of times, without SGLang. This module gives them:

- ``open_engines``: load an engines manifest and check it fits the model and the bit-width, with
  errors a CLI can show as they are (``FileNotFoundError`` / ``ValueError``).
- ``LayerVariants``: swaps whole decoder layers of a float32 HF model between full precision and
  the effective weights (``formats.get_format(bits).dequantize``) of one built variant.
- ``LayerRunner``: runs the decoder stack one layer at a time for fixed token windows, so a caller
  can keep the hidden state at every layer input and restart from any layer.
- ``PerplexityEvaluator``: perplexity of fixed windows with a set of layers quantized, restarting
  from the first quantized layer on cached full-precision hidden states.
- token windows from a text file (calibration samples, evaluation windows).

Everything runs in float32 on CPU: quantization error, not bf16 rounding, is what is measured.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sglang_morph.engines.formats import FULL_PRECISION_BITS, get_format
from sglang_morph.engines.manifest import LINEAR_NAMES, EngineManifest, read_variant

MODEL_DTYPE = torch.float32


def read_hf_config(model_path: Path) -> dict[str, Any]:
    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_path} is not a model directory (no config.json)")
    return json.loads(config_path.read_text())


def open_engines(engines_dir: Path, model_path: Path, bits: int) -> EngineManifest:
    """The manifest of ``engines_dir`` after checking it was built for ``model_path`` and has

    ``bits``-bit variants. Cheap (reads JSON only), so CLIs call it before loading any weights.
    """
    manifest = EngineManifest.load(Path(engines_dir))
    manifest.check_matches_model(read_hf_config(model_path))
    if bits == FULL_PRECISION_BITS:
        raise ValueError(f"bits {bits} is full precision: there is no quantized variant to install")
    if bits not in manifest.bits_available:
        quantized = [b for b in manifest.bits_available if b != FULL_PRECISION_BITS]
        raise ValueError(
            f"{engines_dir} has no {bits}-bit variants; it was built with bits {quantized}"
        )
    return manifest


def load_model(model_path: Path) -> torch.nn.Module:
    """A Llama-style HF causal LM in float32, eval mode, SDPA attention (causal without a mask)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_path, dtype=MODEL_DTYPE, attn_implementation="sdpa", local_files_only=True
    ).eval()


def load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def effective_weights(
    engines_dir: Path, manifest: EngineManifest, layer_index: int, bits: int
) -> dict[str, torch.Tensor]:
    """Linear name -> dequantized float32 weight ``[out, in]`` of one layer's variant file."""
    fmt = get_format(bits)
    return {
        linear: fmt.dequantize(tensors).to(MODEL_DTYPE)
        for linear, tensors in read_variant(engines_dir, manifest.variant(layer_index, bits)).items()
    }


class LayerVariants:
    """Switches decoder layers of ``model`` between full precision and one quantized variant.

    Invariant: the linears of layer ``l`` hold the variant's effective weights iff ``l`` is in
    ``quantized_layers``, else the model's own full-precision Parameters. Both sets of Parameters
    are kept and swapped by reference, so switching back is exact and costs no copy.
    """

    def __init__(
        self, model: torch.nn.Module, engines_dir: Path, manifest: EngineManifest, bits: int,
        progress: bool = True,
    ):
        self.bits = bits
        self._layers = decoder_layers(model)
        if len(self._layers) != manifest.num_layers:
            raise ValueError(
                f"model has {len(self._layers)} decoder layers, manifest {manifest.num_layers}"
            )
        self._full_precision: list[dict[str, torch.nn.Parameter]] = []
        self._quantized: list[dict[str, torch.nn.Parameter]] = []
        for index in tqdm(range(len(self._layers)), desc=f"Loading W{bits} variants",
                          unit="layer", disable=not progress):
            fp = {name: self._linear(index, name).weight for name in LINEAR_NAMES}
            quantized = {}
            for name, weight in effective_weights(engines_dir, manifest, index, bits).items():
                if weight.shape != fp[name].shape:
                    raise ValueError(
                        f"layer {index} {name}: variant weight {tuple(weight.shape)} does not fit "
                        f"the model's {tuple(fp[name].shape)}"
                    )
                quantized[name] = torch.nn.Parameter(weight, requires_grad=False)
            self._full_precision.append(fp)
            self._quantized.append(quantized)
        self._current: frozenset[int] = frozenset()

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def quantized_layers(self) -> frozenset[int]:
        return self._current

    def set_quantized(self, layers: Iterable[int]) -> None:
        target = frozenset(layers)
        for index in target ^ self._current:
            if not 0 <= index < self.num_layers:
                raise ValueError(f"layer {index} out of range 0..{self.num_layers - 1}")
            source = self._quantized if index in target else self._full_precision
            for name, param in source[index].items():
                self._linear(index, name).weight = param
        self._current = target

    @contextmanager
    def quantized(self, layers: Iterable[int]) -> Iterator[None]:
        """Quantize exactly ``layers`` inside the block; the previous set is restored after."""
        previous = self._current
        self.set_quantized(layers)
        try:
            yield
        finally:
            self.set_quantized(previous)

    def _linear(self, layer_index: int, name: str) -> torch.nn.Linear:
        return self._layers[layer_index].get_submodule(name)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers


class LayerRunner:
    """Runs a Llama-style HF model's decoder one layer at a time on fixed ``input_ids``.

    ``input_ids`` is ``[windows, tokens]`` with no padding, so every row is a full causal sequence
    starting at position 0. Rotary embeddings and the causal mask are built once, exactly as the
    model's own forward builds them, so ``run(embed(), 0)`` followed by ``final_norm`` equals
    ``model.model(input_ids).last_hidden_state``. Hidden states are ``[windows, tokens, hidden]``.
    """

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor):
        from transformers.masking_utils import create_causal_mask

        self.model = model
        self.input_ids = input_ids
        self._decoder = model.model
        with torch.inference_mode():
            embeddings = self._decoder.embed_tokens(input_ids)
            self.position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
            self.position_embeddings = self._decoder.rotary_emb(
                embeddings, position_ids=self.position_ids
            )
            self.attention_mask = create_causal_mask(
                config=model.config, inputs_embeds=embeddings, attention_mask=None,
                past_key_values=None, position_ids=self.position_ids,
            )
        self._embeddings = embeddings

    @property
    def num_layers(self) -> int:
        return len(self._decoder.layers)

    def embed(self) -> torch.Tensor:
        return self._embeddings

    @torch.inference_mode()
    def layer(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._decoder.layers[index](
            hidden,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            position_embeddings=self.position_embeddings,
        )

    def run(self, hidden: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        """Layers ``start .. stop-1`` (default: to the last layer) applied to ``hidden``."""
        for index in range(start, self.num_layers if stop is None else stop):
            hidden = self.layer(index, hidden)
        return hidden

    def layer_inputs(self) -> list[torch.Tensor]:
        """Hidden state at the input of every layer under the current weights; entry
        ``num_layers`` is the last layer's output (before the final norm)."""
        states = [self.embed()]
        for index in range(self.num_layers):
            states.append(self.layer(index, states[-1]))
        return states

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head sees: the model's final RMSNorm of the last layer's output."""
        return self._decoder.norm(hidden)

    @torch.inference_mode()
    def next_token_nll(self, hidden: torch.Tensor) -> tuple[float, int]:
        """Summed negative log-likelihood (nats) of tokens 1.. of each row given the prefix, and

        how many tokens that is. Logits are built one row at a time: for a 512-token row over a
        49k vocabulary they already take 0.1 GB in float32.
        """
        nll_sum_nats = 0.0
        for row in range(hidden.shape[0]):
            logits = self.model.lm_head(self.final_norm(hidden[row, :-1]))
            nll_sum_nats += F.cross_entropy(
                logits, self.input_ids[row, 1:], reduction="sum"
            ).item()
        return nll_sum_nats, hidden.shape[0] * (hidden.shape[1] - 1)


class PerplexityEvaluator:
    """Perplexity of fixed windows with a chosen set of layers quantized.

    The full-precision hidden state at every layer input is computed once; a set whose first
    quantized layer is ``m`` reruns only layers ``m ..`` (layers before ``m`` are full precision, so
    their outputs are the cached ones). Results are memoized by set, since tables repeat sets
    (e.g. "all layers" under every order). Perplexity = exp(mean next-token NLL over all windows).
    """

    def __init__(self, runner: LayerRunner, variants: LayerVariants):
        self._runner = runner
        self._variants = variants
        with variants.quantized(()):
            self._fp_inputs = runner.layer_inputs()
        self._memo: dict[frozenset[int], float] = {}

    @property
    def evaluated_tokens(self) -> int:
        windows, tokens = self._runner.input_ids.shape
        return windows * (tokens - 1)

    def perplexity(self, quantized_layers: Iterable[int]) -> float:
        layers = frozenset(quantized_layers)
        if layers not in self._memo:
            start = min(layers, default=self._runner.num_layers)
            with self._variants.quantized(layers):
                hidden = self._runner.run(self._fp_inputs[start], start)
                nll_sum_nats, count = self._runner.next_token_nll(hidden)
            self._memo[layers] = math.exp(nll_sum_nats / count)
        return self._memo[layers]


def mean_token_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of ``a`` and ``b`` along the hidden dimension, averaged over all tokens.

    Computed in float64: scores of neighbouring layers differ in the 4th-6th decimal.
    """
    return F.cosine_similarity(a.double(), b.double(), dim=-1).mean().item()


def read_token_ids(tokenizer, text_path: Path) -> list[int]:
    """The whole text as one token sequence, no special tokens (plain-text language modelling)."""
    return tokenizer(Path(text_path).read_text(), add_special_tokens=False, verbose=False)[
        "input_ids"
    ]


def first_windows(token_ids: list[int], num_windows: int, window_tokens: int) -> torch.Tensor:
    """``[num_windows, window_tokens]``: consecutive non-overlapping windows from the start."""
    needed = num_windows * window_tokens
    if len(token_ids) < needed:
        raise ValueError(f"text has {len(token_ids)} tokens, {needed} needed")
    return torch.tensor(token_ids[:needed]).view(num_windows, window_tokens)


def sampled_windows(
    token_ids: list[int], num_windows: int, window_tokens: int, seed: int
) -> torch.Tensor:
    """``[num_windows, window_tokens]``: distinct non-overlapping windows drawn with ``seed``,

    in text order, so a calibration set spans the text instead of one article.
    """
    available = len(token_ids) // window_tokens
    if available < num_windows:
        raise ValueError(
            f"text has {len(token_ids)} tokens: {available} windows of {window_tokens}, "
            f"{num_windows} needed"
        )
    starts = sorted(random.Random(seed).sample(range(available), num_windows))
    return torch.tensor(
        [token_ids[s * window_tokens:(s + 1) * window_tokens] for s in starts]
    )
