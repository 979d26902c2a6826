"""Pipeline parallelism for Llama models with tied input and output embeddings, on CPU.

SGLang 0.5.23's ``LlamaForCausalLM`` sets ``lm_head = model.embed_tokens`` when the config ties
them; under pipeline parallelism only the first stage holds ``embed_tokens``, so the last stage's
``lm_head`` is a ``PPMissingLayer`` and its first forward fails
(``'PPMissingLayer' object has no attribute 'quant_method'``). The default model (SmolLM2)
ties them. The hooks give the last stage its own ``ParallelLMHead`` and fill it from the
checkpoint's ``model.embed_tokens.weight``, which every stage's loader sees (SGLang's Qwen2 does
the same in-tree). Nothing changes when the embeddings are untied, without pipeline
parallelism, on stages other than the last, or off CPU (the plugin's CPU-only rule).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator
from typing import Any, Callable

from sglang_morph.parallel.cpu import on_cpu

logger = logging.getLogger("sglang_morph.parallel")


EMBEDDING_WEIGHT = "model.embed_tokens.weight"
# Set on a model whose last stage got its own head; load_weights fills it.
_UNTIED_HEAD_ATTR = "morph_untied_lm_head"


def after_llama_init(_result: None, model: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.layers.utils import PPMissingLayer

    if on_cpu() and model.pp_group.world_size > 1:
        # Which layers a stage holds is otherwise invisible (SGLANG_PP_LAYER_PARTITION).
        logger.info("sglang-morph: pipeline stage %d of %d holds decoder layers %d-%d",
                    model.pp_group.rank_in_group, model.pp_group.world_size,
                    model.model.start_layer, model.model.end_layer - 1)
    if not (on_cpu() and model.config.tie_word_embeddings and model.pp_group.world_size > 1
            and model.pp_group.is_last_rank and isinstance(model.lm_head, PPMissingLayer)):
        return
    from sglang.srt.distributed.parallel_state import get_parallel
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.utils import add_prefix

    bound = inspect.signature(type(model).__init__).bind(model, *args, **kwargs)
    bound.apply_defaults()
    model.lm_head = ParallelLMHead(
        model.config.vocab_size,
        model.config.hidden_size,
        quant_config=model.quant_config,
        prefix=add_prefix("lm_head", bound.arguments.get("prefix", "")),
        use_attn_tp_group=get_parallel().enable_dp_lm_head,
    )
    setattr(model, _UNTIED_HEAD_ATTR, True)


def around_llama_load_weights(original: Callable[..., Any], model: Any,
                               weights: Iterable[tuple[str, Any]], *args: Any,
                               **kwargs: Any) -> Any:
    if not getattr(model, _UNTIED_HEAD_ATTR, False):
        return original(model, weights, *args, **kwargs)
    head = model.lm_head.weight
    filled = []

    def fill_head_from_embedding() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name == EMBEDDING_WEIGHT:
                head.weight_loader(head, tensor)  # shards the vocabulary like the embedding
                filled.append(name)
            yield name, tensor

    loaded = original(model, fill_head_from_embedding(), *args, **kwargs)
    # A load without the embedding (a partial update) leaves the head as it was.
    if filled and isinstance(loaded, set):
        loaded.add("lm_head.weight")
    return loaded
