"""Greedy /generate equals transformers' greedy generate on the same safetensors directory.

Token-for-token equality needs the same numerics on both sides, so the exact comparison runs
in float32 (server ``--dtype float32``, transformers ``dtype=float32``). In bfloat16 the two
stacks round differently (fused vs unfused ops) and bf16 logits tie often (on this AVX2-only
CPU "The three primary colors are" gives three tokens the same logit 21.0 at the fourth step),
so there a token may differ only at a tie: transformers, fed the server's own output, must rank
each token the server chose within a bf16 rounding step of its best.
That server also runs with ``--enable-morph``: enabling the plugin must not change outputs.
"""

from __future__ import annotations

import pytest
import requests
import torch

PROMPTS_AND_NEW_TOKENS = [
    ("The capital of France is", 24),
    ("def fibonacci(n):\n", 40),
    ("Once upon a time, in a small village by the sea,", 32),
    ("The three primary colors are", 20),
    ("Water boils at a temperature of", 28),
    ("<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n", 36),
]
# How far below transformers' best logit the server's choice may be: two bf16 steps at the
# best logit's magnitude (bf16 keeps 8 significant bits).
BF16_TIE_STEPS = 2


def _hf_greedy(model_path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    out = []
    for prompt, n_new in PROMPTS_AND_NEW_TOKENS:
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False)
        out.append((ids, gen[0, len(ids):].tolist()))
    return out


def _server_greedy(server, ids, n_new):
    r = requests.post(
        f"{server.url}/generate",
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new}},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def fp32_morph_server(server_factory, engines_awq):
    # The session's variants, not a first-use build: that one has its own test.
    return server_factory("--dtype", "float32", "--enable-morph", "--morph-engines",
                          str(engines_awq))


def test_fp32_greedy_equals_transformers_token_for_token(fp32_morph_server, default_model_path):
    for (ids, expected), (prompt, n_new) in zip(
        _hf_greedy(default_model_path, torch.float32), PROMPTS_AND_NEW_TOKENS
    ):
        assert len(expected) >= 20 or expected[-1] == 2, "transformers stopped early"
        assert _server_greedy(fp32_morph_server, ids, n_new) == expected, prompt


def test_morph_flag_reaches_the_scheduler(fp32_morph_server):
    info = requests.get(f"{fp32_morph_server.url}/get_server_info", timeout=30).json()
    line = f"kv_capacity_tokens={info['max_total_num_tokens']}"
    assert "sglang-morph enabled in scheduler: LlamaForCausalLM, 30 decoder layers" in (
        fp32_morph_server.log_text()
    )
    assert line in fp32_morph_server.log_text()


def test_bf16_default_server_agrees_with_transformers_bf16(default_server, default_model_path):
    """Teacher-forced: transformers bf16 scores the server's greedy sequence in one forward;
    every token the server picked is transformers' argmax or tied with it within
    ``BF16_TIE_STEPS`` bf16 steps. A wrong kernel or a wrong layer picks tokens far below."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path,
                                                 dtype=torch.bfloat16).eval()
    exact = 0
    for prompt, n_new in PROMPTS_AND_NEW_TOKENS:
        ids = tok(prompt)["input_ids"]
        got = _server_greedy(default_server, ids, n_new)
        assert len(got) >= 20 or got[-1] == 2, (prompt, got)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1:].float()
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(len(got)), torch.tensor(got)]
        step = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)
        gap = best - chosen
        assert bool((gap <= BF16_TIE_STEPS * step).all()), (
            prompt, [(i, t, round(float(g), 3)) for i, (t, g) in enumerate(zip(got, gap)) if g > 0])
        exact += int(bool((gap == 0).all()))
    # Ties are the exception: most sequences are transformers' argmax at every step.
    assert exact >= len(PROMPTS_AND_NEW_TOKENS) // 2, exact
