"""Layer Importance Score profile (MorphServe Alg. 1): the order in which to quantize layers.

    python -m sglang_morph.morph.profile_layers [--model-path M] --engines PATH [--bits 4]
        [--samples 8] [--tokens-per-sample 128] [--seed 0] [--out swap_order.json]

Scores, all cosine similarities averaged over every calibration token (cosine along the hidden
dimension per token, then the mean), all oriented so that HIGHER means SAFER to quantize first:

- LTS(l), layer transformation similarity: cos(input of layer l, output of layer l) in the
  full-precision model. High: the layer barely changes its residual stream, so it matters less.
- LRS(l), layer replacement similarity: cos(output of layer l, output of the quantized layer l),
  both fed the same full-precision input. High: the variant reproduces the layer well.
- MDS(Q, p), model degradation similarity: cos(model output with layers Q quantized, model output
  with Q u {p} quantized), where "model output" is the final hidden state after the model's
  final RMSNorm, i.e. exactly the LM head's input. High: adding p to the swapped set barely moves
  what the model predicts from. Final hidden states rather than logits: the LM head is a fixed
  linear map of them, and 2k tokens x 49k vocabulary logits would cost more than a decoder layer.
- LIS(p | Q) = 0.25 LTS(p) + 0.25 LRS(p) + 0.5 MDS(Q, p).

Greedy: Q = {}; at each step add the not-yet-quantized layer with the highest LIS(p | Q) (ties go
to the lower index). LTS and LRS do not depend on Q and are computed once; MDS needs the model
run again for every candidate at every step, i.e. O(L^2) runs. Two things keep that cheap, both
exact (the order is the one exhaustive evaluation gives; a test checks it):

- The hidden state at every layer input *with the current Q quantized* is cached: layers before
  p are the same under Q and Q u {p}, so a candidate p runs only layers p..L-1, and the winner's
  run becomes the new cache. Exhaustively that is sum over steps and candidates of (L - p) layer
  forwards: about L^3/4, ~7k for 30 layers.
- Pruning: MDS <= 1, so LIS(p | Q) <= 0.25 LTS(p) + 0.25 LRS(p) + 0.5 =: bound(p). Candidates are
  tried in decreasing bound; once a bound falls below the best LIS found, no later candidate can
  win and their MDS is not computed. LTS varies across layers far more than MDS (on the default
  model, LTS 0.02..0.98, MDS 0.99..0.999), so most candidates are pruned. Their scores are
  written with ``"mds": null, "lis": null``; ``--all-scores`` computes every one (for analysis).

Calibration: distinct non-overlapping windows of the WikiText-2 TRAIN split head, drawn with a
fixed seed (never the test split, which the quality benchmarks evaluate on); float32 model.

The JSON written to ``--out``: ``{"model", "engines", "bits", "calibration", "weights",
"order", "steps": [{"step", "chosen", "scores": {layer: {"lts", "lrs", "mds", "lis",
"lis_upper_bound"}}}], ...}`` with every candidate of each step in ``scores``;
``sglang_morph.morph.swap_order.load_swap_order`` reads its ``"order"``.
Bad input (no engines directory, engines of another model, no variants of ``--bits``) exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sglang_morph.engines.hf_variants import (
    LayerRunner,
    LayerVariants,
    load_model,
    load_tokenizer,
    mean_token_cosine,
    open_engines,
    read_token_ids,
    sampled_windows,
)
from sglang_morph.engines.manifest import EngineManifest
from sglang_morph.repo_data import WIKITEXT2_TRAIN_HEAD

TRAIN_TEXT_PATH = WIKITEXT2_TRAIN_HEAD


@dataclass(frozen=True)
class LisWeights:
    lts: float = 0.25
    lrs: float = 0.25
    mds: float = 0.5


@dataclass(frozen=True)
class ProfileConfig:
    model_path: Path
    engines_dir: Path
    bits: int
    calibration_text_path: Path
    num_samples: int
    tokens_per_sample: int
    seed: int
    out_json: Path
    weights: LisWeights = LisWeights()
    all_scores: bool = False
    progress: bool = True


@dataclass(frozen=True)
class LayerScores:
    lts: float
    lrs: float
    lis_upper_bound: float  # LIS with MDS = 1
    mds: float | None  # None: pruned, its bound was below the step's best LIS
    lis: float | None


@dataclass(frozen=True)
class GreedyStep:
    step: int
    chosen: int
    scores: dict[int, LayerScores]  # every candidate of this step (layers not yet quantized)


@dataclass(frozen=True)
class Profile:
    order: tuple[int, ...]
    steps: tuple[GreedyStep, ...]
    lts: tuple[float, ...]
    lrs: tuple[float, ...]
    layer_forwards: int  # decoder-layer forwards of the calibration batch, all terms together


def static_scores(
    runner: LayerRunner, variants: LayerVariants, fp_inputs: Sequence[torch.Tensor]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(LTS, LRS) of every layer from the full-precision layer inputs ``fp_inputs``."""
    lts, lrs = [], []
    for index in range(runner.num_layers):
        fp_output = fp_inputs[index + 1]
        lts.append(mean_token_cosine(fp_inputs[index], fp_output))
        with variants.quantized({index}):
            lrs.append(mean_token_cosine(fp_output, runner.layer(index, fp_inputs[index])))
    return tuple(lts), tuple(lrs)


def greedy_profile(
    runner: LayerRunner, variants: LayerVariants, weights: LisWeights = LisWeights(),
    all_scores: bool = False, progress: bool = True,
) -> Profile:
    """MorphServe Alg. 1 on ``runner``'s calibration windows; see the module docstring.

    ``all_scores``: compute MDS for every candidate instead of pruning (same order, slower).
    """
    num_layers = runner.num_layers
    with variants.quantized(()):
        fp_inputs = runner.layer_inputs()
    lts, lrs = static_scores(runner, variants, fp_inputs)
    layer_forwards = 2 * num_layers
    # Cosines are computed in float64 but may still round a hair above 1.
    bounds = [weights.lts * lts[i] + weights.lrs * lrs[i] + weights.mds * (1 + 1e-12)
              for i in range(num_layers)]

    # Hidden state at each layer input (entry L: last layer's output) with `quantized` swapped.
    inputs = list(fp_inputs)
    quantized: list[int] = []
    steps = []
    bar = tqdm(total=num_layers * (num_layers + 1) // 2, desc="LIS greedy", unit="candidate",
               disable=not progress)
    with bar:
        for step in range(num_layers):
            output = runner.final_norm(inputs[num_layers])
            scores: dict[int, LayerScores] = {}
            best, best_states = None, None
            candidates = sorted(set(range(num_layers)) - set(quantized),
                                key=lambda layer: (-bounds[layer], layer))
            for candidate in candidates:
                if not all_scores and best is not None and bounds[candidate] < scores[best].lis:
                    scores[candidate] = LayerScores(lts[candidate], lrs[candidate],
                                                    bounds[candidate], None, None)
                    bar.update()
                    continue
                with variants.quantized([*quantized, candidate]):
                    states = [inputs[candidate]]
                    for index in range(candidate, num_layers):
                        states.append(runner.layer(index, states[-1]))
                layer_forwards += num_layers - candidate
                mds = mean_token_cosine(output, runner.final_norm(states[-1]))
                lis = (weights.lts * lts[candidate] + weights.lrs * lrs[candidate]
                       + weights.mds * mds)
                scores[candidate] = LayerScores(lts[candidate], lrs[candidate], bounds[candidate],
                                                mds, lis)
                if best is None or (lis, -candidate) > (scores[best].lis, -best):
                    best, best_states = candidate, states
                bar.update()
            quantized.append(best)
            inputs[best:] = best_states
            steps.append(GreedyStep(step, best, dict(sorted(scores.items()))))
            bar.set_postfix_str(f"step {step}: layer {best}")
    return Profile(tuple(quantized), tuple(steps), lts, lrs, layer_forwards)


def profile_to_json(config: ProfileConfig, profile: Profile, duration_s: float) -> dict:
    return {
        "model": str(config.model_path),
        "engines": str(config.engines_dir),
        "bits": config.bits,
        "num_layers": len(profile.order),
        "calibration": {
            "text": str(config.calibration_text_path),
            "num_samples": config.num_samples,
            "tokens_per_sample": config.tokens_per_sample,
            "seed": config.seed,
            "windows": "distinct non-overlapping windows of the tokenized text, drawn with seed",
            "dtype": "float32",
        },
        "weights": dataclasses.asdict(config.weights),
        "model_output": "final hidden states after the model's final norm (LM head input)",
        "order": list(profile.order),
        "steps": [
            {
                "step": s.step,
                "chosen": s.chosen,
                "scores": {str(layer): dataclasses.asdict(v) for layer, v in s.scores.items()},
            }
            for s in profile.steps
        ],
        "all_scores": config.all_scores,
        "layer_forwards": profile.layer_forwards,
        "duration_s": duration_s,
        "torch_threads": torch.get_num_threads(),
    }


def prepare(config: ProfileConfig) -> tuple[EngineManifest, torch.Tensor]:
    """The checked manifest and the calibration windows: every input check, before any weights

    load. Raises FileNotFoundError / ValueError with a message meant for the user.
    """
    manifest = open_engines(config.engines_dir, config.model_path, config.bits)
    calibration_ids = sampled_windows(
        read_token_ids(load_tokenizer(config.model_path), config.calibration_text_path),
        config.num_samples, config.tokens_per_sample, config.seed,
    )
    return manifest, calibration_ids


def run(config: ProfileConfig, manifest: EngineManifest, calibration_ids: torch.Tensor) -> dict:
    """Profile and write ``config.out_json`` (``manifest``, ``calibration_ids``: ``prepare``'s)."""
    started_s = time.monotonic()
    model = load_model(config.model_path)
    variants = LayerVariants(model, config.engines_dir, manifest, config.bits, config.progress)
    profile = greedy_profile(LayerRunner(model, calibration_ids), variants, config.weights,
                             config.all_scores, config.progress)
    report = profile_to_json(config, profile, time.monotonic() - started_s)
    report["engines_recipe"] = manifest.recipe  # an RTN order and an AWQ order are not the same
    config.out_json.parent.mkdir(parents=True, exist_ok=True)
    config.out_json.write_text(json.dumps(report, indent=1) + "\n")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_morph.morph.profile_layers",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path,
                        help="HF model directory (default: the embedded default model)")
    parser.add_argument("--engines", type=Path, required=True, help="built engines directory")
    parser.add_argument("--bits", type=int, default=4, help="variant to profile (default 4)")
    parser.add_argument("--calibration-text", type=Path, default=TRAIN_TEXT_PATH,
                        help="calibration text, a TRAIN split (default: WikiText-2 train head)")
    parser.add_argument("--samples", type=int, default=8, help="calibration windows (default 8)")
    parser.add_argument("--tokens-per-sample", type=int, default=128,
                        help="tokens per calibration window (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="window draw seed (default 0)")
    parser.add_argument("--out", type=Path, default=Path("swap_order.json"))
    parser.add_argument("--all-scores", action="store_true",
                        help="compute MDS for every candidate instead of pruning (same order)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.samples < 1 or args.tokens_per_sample < 2:
        parser.error("--samples must be >= 1 and --tokens-per-sample >= 2")
    if not args.calibration_text.is_file():
        parser.error(f"calibration text {args.calibration_text} does not exist")
    if args.model_path is None:
        from sglang_morph.models import default_model_path

        args.model_path = default_model_path()
    config = ProfileConfig(
        model_path=args.model_path.resolve(),
        engines_dir=args.engines.resolve(),
        bits=args.bits,
        calibration_text_path=args.calibration_text.resolve(),
        num_samples=args.samples,
        tokens_per_sample=args.tokens_per_sample,
        seed=args.seed,
        out_json=args.out.resolve(),
        all_scores=args.all_scores,
        progress=not args.no_progress,
    )
    try:
        manifest, calibration_ids = prepare(config)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    report = run(config, manifest, calibration_ids)
    print(f"order: {report['order']}")
    print(f"wrote {config.out_json} in {report['duration_s']:.1f} s "
          f"({report['layer_forwards']} layer forwards)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
