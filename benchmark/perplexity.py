"""Perplexity through a running SGLang server: ``/generate`` with input-token logprobs.

``python -m benchmark.perplexity --url http://127.0.0.1:30000 [--text FILE] [--max-tokens 3072]
[--window-tokens 512]`` tokenizes the text with the served model's tokenizer, cuts the first
``max_tokens`` tokens into non-overlapping windows, and sends each window as ``input_ids`` with
``max_new_tokens=0, return_logprob=true, logprob_start_len=0``. Each window's first token has no
logprob (nothing precedes it), so ``window_tokens - 1`` tokens per window are scored:
perplexity = exp(mean negative log-likelihood over all scored tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import requests

from sglang_morph.repo_data import WIKITEXT2_TEST as DEFAULT_TEXT


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    scored_tokens: int
    windows: int
    window_tokens: int
    text: str
    # mean NLL (nats) of each window's scored tokens, in text order: runs on the same windows
    # compare window by window (paired), with the windows as independent samples
    window_nll: tuple[float, ...] = ()


def token_windows(token_ids: list[int], window_tokens: int) -> list[list[int]]:
    """Non-overlapping full windows; a trailing partial window is dropped so every window is

    scored with the same context length.
    """
    n = len(token_ids) // window_tokens
    return [token_ids[i * window_tokens : (i + 1) * window_tokens] for i in range(n)]


def server_perplexity(url: str, text_path: Path = DEFAULT_TEXT, max_tokens: int = 3072,
                      window_tokens: int = 512, timeout_s: float = 600) -> PerplexityResult:
    from transformers import AutoTokenizer

    info = requests.get(f"{url}/get_model_info", timeout=30).json()
    tokenizer = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    text = Path(text_path).read_text()
    # Tokenizing the whole corpus would be wasted work; text averages well under 8 chars/token,
    # and the full text is used when the prefix falls short.
    ids = tokenizer(text[: max_tokens * 8])["input_ids"]
    if len(ids) < max_tokens:
        ids = tokenizer(text)["input_ids"]
    ids = ids[:max_tokens]
    windows = token_windows(ids, window_tokens)
    if not windows:
        raise ValueError(f"{text_path} has fewer than {window_tokens} tokens")
    nll_sum, scored, window_nll = 0.0, 0, []
    for window in windows:
        r = requests.post(
            f"{url}/generate",
            json={"input_ids": window, "return_logprob": True, "logprob_start_len": 0,
                  "sampling_params": {"max_new_tokens": 0, "temperature": 0}},
            timeout=timeout_s,
        )
        r.raise_for_status()
        logprobs = [lp for lp, _tok, _ in r.json()["meta_info"]["input_token_logprobs"]]
        if logprobs[0] is not None or len(logprobs) != len(window):
            raise RuntimeError("unexpected input_token_logprobs layout from the server")
        nll_sum -= sum(logprobs[1:])
        scored += len(logprobs) - 1
        window_nll.append(-sum(logprobs[1:]) / (len(logprobs) - 1))
    return PerplexityResult(math.exp(nll_sum / scored), scored, len(windows), window_tokens,
                            str(text_path), tuple(window_nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--max-tokens", type=int, default=3072)
    parser.add_argument("--window-tokens", type=int, default=512)
    args = parser.parse_args()
    if not args.text.is_file():
        parser.error(f"--text {args.text} does not exist")
    result = server_perplexity(args.url, args.text, args.max_tokens, args.window_tokens)
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    main()
