"""A tiny Llama with random weights, for parallel layouts the default model cannot take.

The default model has 9 query / 3 KV heads, so SGLang can shard it only over 1 or 3 tensor-
parallel ranks. This model has 8 query / 4 KV heads (TP 1, 2 or 4), untied embeddings and a
few layers, the default model's tokenizer (so prompts and chat templates work the same) and
weights drawn from a fixed seed: every build of one spec is bit-identical. Equality tests
(TP 2 against TP 1, multi-node against one node) need no trained weights.

``python -m sglang_morph.models.tiny path`` builds it once (a few seconds) into
``<cache>/models/<name>`` and prints the directory; later calls only print it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

from sglang_morph.models import build_once, cache_dir, default_model_path

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# Written last: a directory without it is an interrupted build.
SPEC_FILE = "tiny_spec.json"


@dataclasses.dataclass(frozen=True)
class TinyLlamaSpec:
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 512
    max_position_embeddings: int = 4096
    # Larger than Llama's 0.02: random logits then spread enough that greedy argmaxes are far
    # apart compared with the rounding differences of a sharded float32 sum.
    initializer_range: float = 0.08
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads,
               self.head_dim, self.intermediate_size) < 1:
            raise ValueError(f"tiny model sizes must be >= 1: {self}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads cannot be grouped over "
                             f"{self.num_key_value_heads} KV heads")

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def dir_name(self) -> str:
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True)
                                .encode()).hexdigest()[:10]
        return (f"tiny-llama-{self.num_hidden_layers}l-{self.num_attention_heads}q"
                f"{self.num_key_value_heads}kv-{digest}")


DEFAULT_TINY = TinyLlamaSpec()


def tiny_model_dir(spec: TinyLlamaSpec = DEFAULT_TINY) -> Path:
    return cache_dir() / "models" / spec.dir_name


def tiny_model_path(spec: TinyLlamaSpec = DEFAULT_TINY) -> Path:
    """The model's directory, built on first use (atomic, locked against concurrent builds)."""
    return build_once(tiny_model_dir(spec), lambda d: (d / SPEC_FILE).is_file(),
                      lambda partial_dir: _build(spec, partial_dir))


def _build(spec: TinyLlamaSpec, out_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / WEIGHTS_FILE).is_file():
        raise RuntimeError(f"transformers did not write {WEIGHTS_FILE} into {out_dir}")
    (out_dir / SPEC_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=1) + "\n")
    logger.info("Built a tiny Llama (%d layers, %d/%d heads, seed %d)",
                spec.num_hidden_layers, spec.num_attention_heads, spec.num_key_value_heads,
                spec.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_morph.models.tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["path"],
                        help="build the model on first use; print only its directory")
    parser.add_argument("--layers", type=int, default=DEFAULT_TINY.num_hidden_layers)
    parser.add_argument("--heads", type=int, default=DEFAULT_TINY.num_attention_heads)
    parser.add_argument("--kv-heads", type=int, default=DEFAULT_TINY.num_key_value_heads)
    parser.add_argument("--seed", type=int, default=DEFAULT_TINY.seed)
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        spec = dataclasses.replace(DEFAULT_TINY, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    # Libraries may print while building; stdout carries only the path.
    with contextlib.redirect_stdout(sys.stderr):
        model_dir = tiny_model_path(spec)
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
