"""SGLang's own clients against our server: a frontend-language program and bench_serving."""

from __future__ import annotations

import json
import subprocess
import sys

import sglang as sgl

from conftest import DATA_DIR


@sgl.function
def capital_quiz(s, country):
    s += f"The capital of {country} is"
    s += sgl.gen("city", max_tokens=8, temperature=0, stop=["\n", "."])
    s += ". It is a"
    s += sgl.select("kind", choices=[" city", " banana", " planet"])


def test_frontend_language_gen_and_select(default_server):
    backend = sgl.RuntimeEndpoint(default_server.url)
    states = capital_quiz.run_batch(
        [{"country": "France"}, {"country": "Germany"}], backend=backend, temperature=0
    )
    assert "Paris" in states[0]["city"]
    assert "Berlin" in states[1]["city"]
    assert all(st["kind"] == " city" for st in states)
    assert states[0].text().startswith("The capital of France is")


def _sharegpt_file_from_corpus(path, n_conversations: int) -> None:
    """bench_serving's "random" dataset draws its token ids from ShareGPT-format JSON; without

    --dataset-path it would download ShareGPT, so we write one from a real local text corpus.
    """
    paragraphs = [
        p.strip()
        for p in (DATA_DIR / "text" / "wikitext2_train_head.txt").read_text().split("\n")
        if len(p.strip()) > 200
    ][: 2 * n_conversations]
    convs = [
        {"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for i, (q, a) in enumerate(zip(paragraphs[::2], paragraphs[1::2]))
    ]
    path.write_text(json.dumps(convs))


def test_bench_serving_random_dataset(default_server, default_model_path, tmp_path):
    dataset = tmp_path / "sharegpt_from_wikitext.json"
    _sharegpt_file_from_corpus(dataset, n_conversations=16)
    result_file = tmp_path / "bench.jsonl"
    num_prompts = 6
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
         "--base-url", default_server.url, "--tokenizer", str(default_model_path),
         "--dataset-name", "random", "--dataset-path", str(dataset),
         "--num-prompts", str(num_prompts), "--random-input-len", "64",
         "--random-output-len", "16", "--random-range-ratio", "1.0",
         "--request-rate", "inf", "--output-file", str(result_file), "--seed", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text().strip().splitlines()[-1])
    assert result["completed"] == num_prompts
    assert result["total_output_tokens"] == num_prompts * 16
    assert result["output_throughput"] > 0
