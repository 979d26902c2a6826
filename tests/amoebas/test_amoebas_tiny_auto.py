"""AMOEBAs' automatic transitions through a group of four and its pairs: ``--enable-amoebas
--dp-size 4 --max-total-tokens 512`` on the tiny random Llama (float32, greedy, CPU).

Pools per member: 512 tokens alone, about 1,280 in a TP 2 group, about 1,660 in the TP 4 group.

- A prompt only the group of four holds arrives: the four replicas merge.
- While it runs, a prompt a pair would hold arrives and joins the group (the policy places a
  long prompt in a group already merged).
- Once the first is done, the group's long request fits a TP 2 pool: the group splits by
  itself into the pairs ``[0, 1]`` and ``[2, 3]``, not into replicas alone, with the second
  prompt still decoding; the pair without a long request then splits into replicas alone, and
  the other one does once its prompt is done.
- Both outputs equal transformers' greedy output of the same prompt; every replica ends at
  512 tokens with every FFN byte back (the same digest as before the first merge).
"""

from __future__ import annotations

import time

import pytest
import torch

from sglang_morph.models.tiny import tiny_model_path
from test_amoebas_tiny import FOUR, prompt, units
from test_morph_runtime_server import Stream

FOUR_TOKENS, FOUR_NEW = 1500, 16  # only the group of four holds 1,516 tokens
PAIR_TOKENS, PAIR_NEW = 600, 600  # 1,200: a pair holds it; it outlives the first prompt
PAIRS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def dp4_auto(server_factory):
    return server_factory("--model-path", str(tiny_model_path()), "--dtype", "float32",
                          "--dp-size", "4", "--enable-amoebas", "--max-total-tokens", "512")


def greedy(ids: list[int], n_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                             min_new_tokens=n_new)
    return out[0, len(ids):].tolist()


def wait_until(server, done, seen: list, timeout_s: float = 300) -> dict:
    """Polls the status until ``done(status)``; every distinct list of units goes to ``seen``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = units(server)
        if not seen or seen[-1] != status["units"]:
            seen.append(status["units"])
        if done(status):
            return status
        assert time.monotonic() < deadline, (seen, status)
        time.sleep(0.05)


def test_the_group_of_four_splits_into_pairs_then_replicas(dp4_auto):
    four_ids = prompt(101, FOUR_TOKENS)
    pair_ids = prompt(102, PAIR_TOKENS)
    expected = greedy(four_ids, FOUR_NEW), greedy(pair_ids, PAIR_NEW)
    digests = [b["ffn_sha256"] for b in units(dp4_auto, digest=True)["replicas"]]
    seen: list = []
    first = Stream(dp4_auto, four_ids, FOUR_NEW)
    wait_until(dp4_auto, lambda s: s["units"] == [FOUR], seen)
    second = Stream(dp4_auto, pair_ids, PAIR_NEW)
    wait_until(dp4_auto, lambda s: len(s["units"]) > 1, seen)
    assert len(second.ids) < PAIR_NEW  # the pair's long prompt was still decoding
    assert (first.join(), second.join()) == expected
    end = wait_until(dp4_auto, lambda s: s["units"] == [[0], [1], [2], [3]], seen)
    # From the group of four to pairs (the status may show one member's view first), then
    # each pair on its own: never a group of four again, and never four replicas alone
    # before the end.
    after = seen[max(k for k, shape in enumerate(seen) if FOUR in shape) + 1:]
    assert all(all(len(u) <= 2 for u in shape) for shape in after), seen
    assert any(len(u) == 2 for u in after[0]), seen
    splits = [t for b in end["replicas"] for t in b["transitions"]
              if t["action"] == "split" and t["group"] == FOUR]
    assert len(splits) == 4 and {t["trigger"] for t in splits} == {"auto"}
    assert sorted(t["unit"] for t in splits) == sorted(PAIRS * 2)
    assert all("fit a TP 2 pool" in t["reason"] for t in splits)
    for b in end["replicas"]:
        pair = next(p for p in PAIRS if b["replica"] in p)
        last = b["transitions"][-1]
        assert (last["action"], last["group"], last["trigger"], last["unit"]) == (
            "split", pair, "auto", [b["replica"]]), last
    final = units(dp4_auto, digest=True)["replicas"]
    assert [b["ffn_sha256"] for b in final] == digests
    assert all(b["kv_capacity_tokens"] == 512 for b in final)
