"""The micro-batch cuts benchmark (benchmark/kunserve/cuts.py): pure parts, no server."""

from __future__ import annotations

from benchmark.kunserve import cuts


def test_prompts_share_no_prefix_and_have_their_length():
    a, b = cuts.prompt(1, 384), cuts.prompt(2, 384)
    assert len(a) == len(b) == 384 and a[0] != b[0]


def test_cuts_follow_the_model_or_are_equal_without_one():
    assert cuts.cuts_of(None, 384) == [0, 96, 192, 288, 384]
    model = {"alpha_s": 4e-7, "beta_s": 8e-4, "gamma_s": 0.05, "delta_s": 0.0, "epsilon_s": 0.0}
    bounds = cuts.cuts_of(model, 1024)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[-1] == 1024 and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_summary_pairs_each_rounds_arms():
    def run(arm, rnd, seconds):
        return {"arm": arm, "round": rnd, "by_prompt": {
            str(n): {"forward_s": [seconds, seconds + 0.1, seconds - 0.1], "ttft_s": [seconds]}
            for n in cuts.PROMPT_TOKENS}}

    runs = [run("tokens", 1, 1.0), run("cost", 1, 0.9), run("cost", 2, 1.2),
            run("tokens", 2, 1.0)]
    s = cuts.summarize(runs)["384"]
    assert s["per_round"] == [0.9, 1.2]
    assert s["forward_s"]["tokens"]["median"] == 1.0
    assert s["cost_over_tokens"]["min"] == 0.9 and s["cost_over_tokens"]["max"] == 1.2
