"""The planner's memory model against the real thing: the engines manifest (stored bytes), the
tensors the CPU kernels actually hold after ``morph_kernels.prepare`` (installed bytes), and
the KV page arithmetic."""

from __future__ import annotations

import random

import morph_kernels
import pytest
import torch

from sglang_morph.engines.manifest import EngineManifest, read_variant
from sglang_morph.engines.variants import FUSED_LINEARS, fuse_stored
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import SIMULATED_MODELS, ModelSpec
from sglang_morph.models.workload import Workload

N_RANDOM_MAPS = 50


@pytest.fixture(scope="module")
def spec(default_model_path) -> ModelSpec:
    return ModelSpec.from_model_dir(default_model_path)


@pytest.fixture(scope="module")
def manifest(engines_awq) -> EngineManifest:
    return EngineManifest.load(engines_awq)


@pytest.fixture(scope="module")
def installed_bytes(engines_awq, manifest) -> dict[tuple[int, int, torch.dtype], int]:
    """(layer, bits, activation dtype) -> bytes of the prepared CPU tensors, as the installer
    builds them (fused per SGLang linear, then ``morph_kernels.prepare``)."""
    out = {}
    for layer in range(manifest.num_layers):
        for bits in (8, 4):
            fused = {path: fuse_stored(read_variant(engines_awq, manifest.variant(layer, bits)),
                                       parts)
                     for path, parts in FUSED_LINEARS.items()}
            for dtype in (torch.bfloat16, torch.float32):
                out[(layer, bits, dtype)] = sum(
                    morph_kernels.prepare(bits, tensors, device="cpu", act_dtype=dtype).device_bytes
                    for tensors in fused.values())
    return out


def _random_maps(num_layers: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice((16, 8, 4)) for _ in range(num_layers)] for _ in range(N_RANDOM_MAPS)]


def test_stored_bytes_equal_the_manifest_over_random_maps(spec, manifest):
    from_shapes = MemoryModel.from_spec(spec, layout="stored")
    from_manifest = MemoryModel.from_manifest(spec, manifest)
    for bits_map in _random_maps(spec.num_layers):
        expected = sum(manifest.variant(l, b).device_bytes for l, b in enumerate(bits_map))
        expected += spec.num_layers * spec.norm_bytes_per_layer
        layers = range(spec.num_layers)
        for model in (from_shapes, from_manifest):
            got = sum(model.layer_weight_bytes(l, b) for l, b in zip(layers, bits_map))
            assert got == expected


@pytest.mark.parametrize("dtype,dtype_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_cpu_installed_bytes_equal_prepared_tensors_over_random_maps(
        spec, installed_bytes, dtype, dtype_bytes):
    served = ModelSpec.from_hf_config(
        {**_config_of(spec)}, name=spec.name, dtype_bytes=dtype_bytes)
    model = MemoryModel.from_spec(served, layout="cpu")
    fp_layer = served.linear_params_per_layer * dtype_bytes
    for bits_map in _random_maps(spec.num_layers, seed=1):
        expected = sum(fp_layer if b == 16 else installed_bytes[(l, b, dtype)]
                       for l, b in enumerate(bits_map))
        got = sum(model.layer_bytes[l][b] for l, b in enumerate(bits_map))
        assert got == expected, bits_map


def _config_of(spec: ModelSpec) -> dict:
    return {"num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_word_embeddings,
            "max_position_embeddings": spec.max_position_embeddings}


def test_kv_tokens_within_one_page_of_the_requests_need():
    for page in (1, 4, 16, 64):
        w = Workload(batch_requests=7, prompt_tokens=100, output_tokens=29, page_size=page)
        need = 7 * 129
        assert need <= w.kv_tokens < need + 7 * page  # at most one partial page per request
        assert w.kv_tokens % page == 0


def test_stage_memory_splits_static_tensors_between_first_and_last(spec):
    model = MemoryModel.from_spec(spec)
    w = Workload(8, 128, 32)
    bits = [16] * spec.num_layers
    whole = model.stage_memory(range(30), bits, w, True, True)
    first = model.stage_memory(range(12), bits[:12], w, True, False)
    last = model.stage_memory(range(12, 30), bits[12:], w, False, True)
    # Split in two, the tied embedding is held twice (input on stage 0, LM head on stage 1),
    # the rotary table on both; KV and layer weights are only divided.
    assert first.weight_bytes + last.weight_bytes == (
        whole.weight_bytes + spec.embedding_bytes + spec.rotary_cache_bytes)
    assert first.kv_bytes + last.kv_bytes == whole.kv_bytes == 30 * w.kv_tokens * 2 * 3 * 64 * 2
    assert model.kv_capacity_tokens(10**8, 6 * 10**7, 30, page_size=16) % 16 == 0


def test_simulated_models_have_published_parameter_counts():
    # Decoder linears only, from the published configs: within 3% of the advertised sizes.
    for name, billions in (("opt-13b", 13), ("opt-30b", 30), ("opt-66b", 66),
                           ("llama-2-13b", 13), ("llama-2-70b", 70)):
        m = SIMULATED_MODELS[name]
        params = m.num_layers * m.linear_params_per_layer + m.vocab_size * m.hidden_size
        assert abs(params / 1e9 - billions) / billions < 0.06, (name, params)
