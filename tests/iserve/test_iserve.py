"""iServe (``sglang_morph.iserve``) without servers: the M2/L2 solves recover known
coefficients from synthetic fingerprint measurements, every intent picks the best row of a
given table, the placement policies, the configuration space, and bad input on the CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from sglang_morph.iserve import __main__ as cli
from sglang_morph.iserve import estimate, intents, measure, placement, space

# Ground truth of the synthetic measurements (bytes / seconds), per TP size.
FIXED = {1: 900e6, 3: 700e6}
PER_LAYER = {1: 12e6, 3: 5e6}
FIRST_DELTA, LAST_DELTA, EMBEDDING = -3e6, 40e6, 56_623_104
LAT = {  # (f0, f1, g0, g1) of TTFT and TPOT per (TP, PP line)
    (1, 1): {"ttft": (0.05, 0.01, 0.004, 0.003), "tpot": (0.02, 0.001, 0.001, 0.0002)},
    (1, 2): {"ttft": (0.08, 0.012, 0.008, 0.006), "tpot": (0.03, 0.0015, 0.002, 0.0004)},
    (3, 1): {"ttft": (0.09, 0.02, 0.009, 0.004), "tpot": (0.05, 0.002, 0.004, 0.0003)},
}
OUTPUTS = (8, 40)


def true_process_bytes(tp, pp, stage, layers):
    """The generative model, written out independently of estimate.MemoryFit."""
    m = FIXED[tp] + layers * PER_LAYER[tp]
    if pp > 1:
        if stage == 0:
            m += FIRST_DELTA / tp
        elif stage == pp - 1:
            m += LAST_DELTA / tp
        else:
            m += (FIRST_DELTA + LAST_DELTA - EMBEDDING) / tp
    return m


def true_seconds(phase, tp, layers, batch, pp):
    def line(key):
        f0, f1, g0, g1 = LAT[key][phase]
        return f0 + f1 * batch + layers * (g0 + g1 * batch)

    f0, f1 = LAT[(1, 1)][phase][:2]
    c0, c1 = LAT[(1, 2)][phase][:2]
    hop = (c0 - f0) + (c1 - f1) * batch  # PP 2's fixed cost over PP 1's
    if pp == 1:
        return line((tp, 1))
    if tp == 1:
        return line((1, 2)) + (pp - 2) * hop
    return line((tp, 1)) + (pp - 1) * hop  # TP x PP: TP 1's hop, an assumption


def synthetic_record(bits, tp, pp, layers, scale=1.0, time_scale=None):
    time_scale = scale if time_scale is None else time_scale
    split = space.stage_layers(layers, pp)
    processes = []
    for stage, rank in itertools.product(range(pp), range(tp)):
        value = true_process_bytes(tp, pp, stage, split[stage]) * scale
        processes.append({"pp_rank": stage, "tp_rank": rank, "weight_bytes": value,
                          "kv_bytes": value / 10, "activation_peak_bytes": value / 100,
                          "rss_hwm_bytes": value * 2, "kv_capacity_tokens": 4096})
    latency = []
    for batch in (1, 4):
        ttft = true_seconds("ttft", tp, layers, batch, pp) * time_scale
        tpot = true_seconds("tpot", tp, layers, batch, pp) * time_scale
        for n in OUTPUTS:
            e2e = ttft + (n - 1) * tpot
            latency.append({"batch": batch, "output_tokens": n, "e2e_s": [e2e],
                            "e2e_median_s": e2e})
    return {"kind": "fingerprint", "config": space.Configuration(bits, tp, pp).name,
            "bits": bits, "tp": tp, "pp": pp, "num_layers": layers, "cpu_s": 10.0,
            "processes": processes, "latency": latency}


def fingerprint_records(bits_scale=None):
    """Lower bit-widths: less memory, more time (as with our CPU kernels at batch > 1)."""
    bits_scale = bits_scale or {16: 1.0, 8: 0.7, 4: 0.5}
    return [synthetic_record(bits, cfg.tp, cfg.pp, n, bits_scale[bits], 1 / bits_scale[bits])
            for bits in bits_scale
            for cfg, n in cli.fingerprint_runs((bits,), (1, 3))]


# ---- M2 / L2 ------------------------------------------------------------------------------


def test_fingerprint_runs_are_the_three_parallel_configurations():
    runs = [(c.name, n) for c, n in cli.fingerprint_runs((8,), (1, 3))]
    assert runs == [("W8-TP1-PP1", 1), ("W8-TP1-PP1", 2), ("W8-TP1-PP2", 2),
                    ("W8-TP1-PP2", 3), ("W8-TP3-PP1", 1), ("W8-TP3-PP1", 2)]


def test_memory_solve_recovers_per_layer_fixed_and_pipeline_terms():
    fits = estimate.fit_records(fingerprint_records({16: 1.0}), 30, EMBEDDING)
    fit = fits.memory[16]["weight_bytes"]
    for tp in (1, 3):
        assert fit.fixed_bytes[tp] == pytest.approx(FIXED[tp], rel=1e-9)
        assert fit.per_layer_bytes[tp] == pytest.approx(PER_LAYER[tp], rel=1e-9)
    assert fit.first_delta_bytes == pytest.approx(FIRST_DELTA, rel=1e-9)
    assert fit.last_delta_bytes == pytest.approx(LAST_DELTA, rel=1e-9)
    # Extrapolated to 30 layers, every layout, against the generative model.
    for tp, pp in itertools.product((1, 3), (1, 2, 3)):
        cfg = space.Configuration(16, tp, pp)
        got = fits.memory_of(cfg)
        split = space.stage_layers(30, pp)
        want = [true_process_bytes(tp, pp, s, n) for s, n in enumerate(split)]
        assert got.total_bytes["weight_bytes"] == pytest.approx(tp * sum(want), rel=1e-9)
        assert got.peak_bytes["weight_bytes"] == pytest.approx(max(want), rel=1e-9)
    # A middle stage holds no embedding: KV and activation figures subtract nothing.
    kv = fits.memory[16]["kv_bytes"]
    assert kv.process_bytes(1, 3, 1, 10) == pytest.approx(
        (FIXED[1] + 10 * PER_LAYER[1] + FIRST_DELTA + LAST_DELTA) / 10, rel=1e-9)


def test_fingerprint_depths_are_a_choice_and_pp_runs_one_layer_more():
    runs = [(c.name, n) for c, n in cli.fingerprint_runs((16,), (1,), (4, 8))]
    assert runs == [("W16-TP1-PP1", 4), ("W16-TP1-PP1", 8), ("W16-TP1-PP2", 5),
                    ("W16-TP1-PP2", 9)]


def test_activation_peak_has_no_depth_term_and_no_figure_goes_negative():
    # One layer's activations at any depth: the fingerprints' peaks differ by stage, not depth.
    peak = {(1, 0): 9e6, (1, 1): 9e6}  # (pp, stage) -> bytes; PP 2 stages below
    points = [estimate.ProcessMemory(1, 1, 0, n, peak[(1, 0)]) for n in (1, 2)]
    points += [estimate.ProcessMemory(1, 2, 0, 1, 2e6), estimate.ProcessMemory(1, 2, 1, 1, 3e6),
               estimate.ProcessMemory(1, 2, 0, 1, 2e6), estimate.ProcessMemory(1, 2, 1, 2, 3e6)]
    fit = estimate.fit_memory("activation_peak_bytes", points, EMBEDDING)
    assert fit.per_layer_bytes[1] == 0.0
    assert fit.process_bytes(1, 1, 0, 30) == pytest.approx(9e6, rel=1e-9)
    assert fit.process_bytes(1, 2, 0, 15) == pytest.approx(2e6, rel=1e-9)
    assert fit.process_bytes(1, 2, 1, 15) == pytest.approx(3e6, rel=1e-9)
    # A middle stage: 9 + (2 - 9) + (3 - 9) = -4 MB from the two deltas; bytes are never < 0.
    assert fit.process_bytes(1, 3, 1, 10) == 0.0
    # The other figures keep their per-layer term (weights scale with depth).
    weights = estimate.fit_memory("weight_bytes", [estimate.ProcessMemory(1, 1, 0, n, 5e6 * n)
                                                   for n in (1, 2)], 0)
    assert weights.per_layer_bytes[1] == pytest.approx(5e6, rel=1e-9)


def test_memory_solve_refuses_measurements_that_cannot_determine_it():
    one_depth = [estimate.ProcessMemory(1, 1, 0, 1, 5.0), estimate.ProcessMemory(1, 1, 0, 1, 5.1)]
    with pytest.raises(ValueError, match="cannot determine"):
        estimate.fit_memory("weight_bytes", one_depth, 0)


def test_ttft_tpot_from_two_output_lengths():
    ttft, tpot = estimate.ttft_tpot({40: 0.5 + 39 * 0.02, 8: 0.5 + 7 * 0.02})
    assert ttft == pytest.approx(0.5) and tpot == pytest.approx(0.02)
    with pytest.raises(ValueError):
        estimate.ttft_tpot({8: 1.0})


def test_latency_solve_recovers_fixed_per_layer_batch_and_hop_terms():
    fits = estimate.fit_records(fingerprint_records({8: 1.0}), 30, EMBEDDING)
    for (tp, pp), want in LAT.items():
        fit = fits.latency[8][tp]
        for phase in ("ttft", "tpot"):
            got = (fit.pp1 if pp == 1 else fit.pp2)[phase]
            assert got == pytest.approx(want[phase], rel=1e-7, abs=1e-12)
    assert fits.latency[8][3].pp2 is None and fits.latency[8][3].hop_from is fits.latency[8][1]
    for tp, pp, batch in itertools.product((1, 3), (1, 2, 3), (1, 2, 8)):
        ttft, tpot = fits.latency_of(space.Configuration(8, tp, pp), batch)
        assert ttft == pytest.approx(true_seconds("ttft", tp, 30, batch, pp), rel=1e-7)
        assert tpot == pytest.approx(true_seconds("tpot", tp, 30, batch, pp), rel=1e-7)


# ---- configuration space ------------------------------------------------------------------

DEFAULT_CONFIG = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}


def test_space_servable_here_and_exclusion_reasons():
    servable = [c.name for c in space.space() if space.exclusion_reason(c, DEFAULT_CONFIG) is None]
    assert len(space.space()) == 18 and len(servable) == 14
    for bits in (8, 4):
        for pp in (2, 3):
            reason = space.exclusion_reason(space.Configuration(bits, 3, pp), DEFAULT_CONFIG)
            assert "refuses --tp-size with --pp-size" in reason
    assert space.exclusion_reason(space.Configuration(16, 3, 3), DEFAULT_CONFIG) is None
    assert "9 query / 3 KV heads" in space.exclusion_reason(space.Configuration(16, 2, 1),
                                                            DEFAULT_CONFIG)


def test_stage_layers_match_sglang(monkeypatch):
    from sglang.srt.distributed.utils import get_pp_indices

    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    for layers, pp in itertools.product((2, 7, 30), (1, 2, 3)):
        want = [b - a for a, b in (get_pp_indices(layers, r, pp) for r in range(pp))]
        assert list(space.stage_layers(layers, pp)) == want


def test_serve_argv_per_configuration(tmp_path):
    w4 = space.serve_argv(space.Configuration(4, 1, 2), tmp_path, tmp_path / "e", 4096, 4)
    assert w4[w4.index("--pp-size") + 1] == "2" and "--tp-size" not in w4
    assert w4[w4.index("--morph-precision-map") + 1] == "*:4"
    assert "--disable-morph-controller" in w4 and w4[w4.index("--max-total-tokens") + 1] == "4096"
    # One pipeline micro-batch holds every running request (SGLang's default splits them).
    assert w4[w4.index("--pp-max-micro-batch-size") + 1] == "4"
    pp1 = space.serve_argv(space.Configuration(4, 1, 1), tmp_path, tmp_path / "e", 4096, 4)
    assert "--pp-max-micro-batch-size" not in pp1
    fp = space.serve_argv(space.Configuration(16, 3, 2), None, None, 4096)
    assert "--enable-morph" not in fp and fp[fp.index("--tp-size") + 1] == "3"
    with pytest.raises(ValueError, match="engines"):
        space.serve_argv(space.Configuration(8, 1, 1), tmp_path, None, 4096)


# ---- intents ------------------------------------------------------------------------------


def table():
    """A hand-made table; the expected winner of each intent is computed below by brute force."""
    rows = []
    rng = np.random.default_rng(3)
    for cfg in space.space():
        if space.exclusion_reason(cfg, DEFAULT_CONFIG):
            continue
        ttft, tpot = rng.uniform(0.05, 2.0), rng.uniform(0.01, 0.3)
        e2e = ttft + 31 * tpot
        memory = rng.uniform(1e9, 8e9)
        rows.append(intents.Candidate(cfg, ttft, tpot, memory, memory / cfg.processes,
                                      cfg.processes * e2e * 10 / 3600,
                                      {16: 29.03, 8: 28.92, 4: 34.40}[cfg.bits], e2e))
    return rows


def winner(spec):
    ranked = intents.rank(table(), spec)
    return next(c for c, why in ranked if why is None)


def test_min_latency_and_min_cost_pick_the_table_minimum():
    rows = table()
    assert winner(intents.IntentSpec("min-latency")) == min(rows, key=lambda c: c.e2e_s)
    for cost in intents.COSTS:
        got = winner(intents.IntentSpec("min-cost", cost=cost))
        assert got == min(rows, key=lambda c: c.cost(cost)), cost
    by_memory = min(rows, key=lambda c: c.memory_bytes)
    assert winner(intents.IntentSpec("min-cost", cost="memory")) == by_memory


def test_latency_target_picks_the_cheapest_that_meets_it():
    rows = table()
    slo_ttft, slo_tpot = 1.0, 0.15
    meets = [c for c in rows if c.ttft_s <= slo_ttft and c.tpot_s <= slo_tpot]
    assert meets and len(meets) < len(rows)
    spec = intents.IntentSpec("latency-target", ttft_slo_s=slo_ttft, tpot_slo_s=slo_tpot)
    assert winner(spec) == min(meets, key=lambda c: c.cost("memory-x-latency"))
    ranked = intents.rank(rows, spec)
    assert {c.cfg for c, why in ranked if why is None} == {c.cfg for c in meets}


def test_cost_budget_picks_the_fastest_within_it():
    rows = table()
    budget = sorted(c.memory_bytes for c in rows)[4]
    spec = intents.IntentSpec("cost-budget", max_memory_bytes=budget)
    within = [c for c in rows if c.memory_bytes <= budget]
    assert winner(spec) == min(within, key=lambda c: c.e2e_s)


def test_accuracy_limit_excludes_w4_for_any_intent():
    rows = table()
    spec = intents.IntentSpec("min-latency", max_perplexity=30.0)
    assert winner(spec) == min((c for c in rows if c.cfg.bits != 4), key=lambda c: c.e2e_s)
    reasons = [why for c, why in intents.rank(rows, spec) if c.cfg.bits == 4]
    assert all("perplexity 34.40 > 30.0" in r for r in reasons)


def test_intent_needs_its_limits():
    with pytest.raises(ValueError, match="ttft-slo"):
        intents.IntentSpec("latency-target").check_integrity()
    with pytest.raises(ValueError, match="max-memory"):
        intents.IntentSpec("cost-budget").check_integrity()
    with pytest.raises(ValueError, match="positive"):
        intents.IntentSpec("min-latency", max_perplexity=-1).check_integrity()


def test_measured_perplexities_are_read_per_bit_width():
    ppl = intents.perplexity_by_bits()
    assert set(ppl) == {16, 8, 4} and ppl[4] > ppl[16]


# ---- placement ----------------------------------------------------------------------------


def cluster():
    return placement.Cluster([placement.Device("big", 20 * 10**9, 4, 0.1),
                              placement.Device("small", 5 * 10**9, 2, 0.0),
                              placement.Device("busy", 10 * 10**9, 2, 0.9)])


def test_placement_policies():
    c = cluster()
    assert c.choose("least-loaded", 4e9, 1).name == "small"
    assert c.choose("packing", 4e9, 1).name == "small"
    assert c.choose("packing", 6e9, 1).name == "busy"  # best fit, whatever its load
    assert c.choose("hybrid", 6e9, 1).name == "big"  # busy would exceed the load threshold
    assert c.choose("least-loaded", 30e9, 1) is None
    # Placing takes memory and adds the processes' share of the cores.
    after = c.place(c.choose("least-loaded", 4e9, 1), 4e9, 1)
    assert after.memory_bytes == 1 * 10**9 and after.load == pytest.approx(0.5)
    assert c.choose("least-loaded", 4e9, 1).name == "big"


def test_cluster_integrity():
    with pytest.raises(ValueError, match="repeat"):
        placement.Cluster([placement.Device("a", 1), placement.Device("a", 1)]).check_integrity()
    with pytest.raises(ValueError, match="load"):
        placement.Device("a", 1, 1, 1.5).check_integrity()


# ---- the CLI ------------------------------------------------------------------------------


@pytest.fixture()
def profile_file(tmp_path, default_model_path):
    records = fingerprint_records()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model_dir": str(default_model_path), "engines_dir": "/e",
                                "num_layers": 30, "embedding_bytes": EMBEDDING,
                                "workload": {"kv_tokens": 4096}, "records": records}))
    return path


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_select_prints_one_command_for_the_chosen_configuration(profile_file, capsys):
    code, out, err = run_cli(capsys, "select", "--profile", str(profile_file), "--intent",
                             "min-latency", "--device", "n0:100GB:4:0.2", "--device",
                             "n1:100GB:4:0.0", "--placement", "least-loaded", "--batch", "4")
    assert code == 0, err
    result = json.loads(out)
    (model,) = result["models"]
    ranking = model["ranking"]
    assert model["chosen"]["config"] == ranking[0]["config"]
    assert ranking[0]["e2e_s"] == min(r["e2e_s"] for r in ranking)
    assert model["device"] == "n1"
    assert set(model["excluded"]) == {"W8-TP3-PP2", "W8-TP3-PP3", "W4-TP3-PP2", "W4-TP3-PP3"}
    assert "scripts/serve.sh" in model["serve"]["command"] and model["serve"]["command"] in err


def test_select_skips_configurations_no_device_can_hold(profile_file, capsys):
    base = ("select", "--profile", str(profile_file), "--intent", "min-latency")
    code, out, _ = run_cli(capsys, *base, "--device", "huge:1000GB")
    ranking = json.loads(out)["models"][0]["ranking"]
    room_gb = ranking[0]["memory_gb"] - 0.01  # the fastest no longer fits
    fitting = [r for r in ranking if r["memory_gb"] <= room_gb]
    assert fitting
    code, out, err = run_cli(capsys, *base, "--device", f"tiny:{room_gb}GB",
                             "--placement", "packing")
    assert code == 0, err
    model = json.loads(out)["models"][0]
    assert model["chosen"]["config"] == fitting[0]["config"]
    assert model["ranking"][0]["infeasible"].startswith("no device has")


@pytest.mark.parametrize("argv, message", [
    (["--intent", "latency-target", "--device", "a:1GB"], "needs --ttft-slo-s"),
    (["--intent", "min-latency", "--device", "a"], "NAME:MEMORY"),
    (["--intent", "min-latency", "--device", "a:lots"], "bad memory size"),
    (["--intent", "min-latency", "--device", "a:1GB:2:3"], "load in [0, 1]"),
    (["--intent", "min-latency", "--device", "a:1GB", "--device", "a:2GB"], "repeat"),
    (["--intent", "min-latency", "--device", "a:1MB"], "no configuration meets"),
    (["--intent", "min-latency", "--device", "a:9GB", "--batch", "0"], "--batch must be"),
    (["--intent", "min-latency", "--device", "a:1GB", "--max-perplexity", "-3"], "positive"),
])
def test_select_bad_input_is_a_cli_error(profile_file, capsys, argv, message):
    code, out, err = run_cli(capsys, "select", "--profile", str(profile_file), *argv)
    assert code == 2 and out == "" and message in err and err.startswith("error: ")


@pytest.mark.parametrize("layers", ["2,2", "1", "1,30", "0,2"])
def test_profile_bad_fingerprint_depths_are_a_cli_error_before_any_server(tmp_path, capsys,
                                                                          layers):
    out = tmp_path / "p.json"
    code, stdout, err = run_cli(capsys, "profile", "--out", str(out), "--engines", "none",
                                "--bits", "16", "--layers", layers)
    assert code == 2 and stdout == "" and "--layers" in err and not out.exists()


def test_profile_tp_pp_without_in_server_is_a_cli_error_before_any_server(tmp_path, capsys):
    out = tmp_path / "p.json"
    code, stdout, err = run_cli(capsys, "profile", "--out", str(out), "--engines", "none",
                                "--bits", "16", "--layers", "8,16", "--tp-pp")
    assert code == 2 and stdout == "" and "--in-server" in err and not out.exists()


def test_missing_profile_and_launch_with_two_models_are_cli_errors(profile_file, tmp_path,
                                                                   capsys):
    code, _, err = run_cli(capsys, "select", "--profile", str(tmp_path / "none.json"),
                           "--intent", "min-latency", "--device", "a:9GB")
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(capsys, "select", "--profile", str(profile_file), "--profile",
                           str(profile_file), "--intent", "min-latency", "--device", "a:99GB",
                           "--launch")
    assert code == 2 and "exactly one --profile" in err
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run_cli(capsys, "estimate", "--profile", str(tmp_path / "bad.json"))
    assert code == 2 and "not a usable profile" in err


def test_pipeline_terms_are_borrowed_when_a_bit_width_has_no_pp_status():
    """16-bit PP runs as plain SGLang (no /morph/status): its weight/KV pipeline deltas come
    from another bit-width (they move the never-quantized embedding and LM head)."""
    records = fingerprint_records({16: 1.0, 8: 1.0})
    for r in records:
        if r["bits"] == 16 and r["pp"] > 1:
            for p in r["processes"]:
                p["weight_bytes"] = p["kv_bytes"] = None
    fits = estimate.fit_records(records, 30, EMBEDDING)
    fit = fits.memory[16]["weight_bytes"]
    assert fit.first_delta_bytes == pytest.approx(FIRST_DELTA, rel=1e-9)
    assert fit.last_delta_bytes == pytest.approx(LAST_DELTA, rel=1e-9)
    assert fit.per_layer_bytes[1] == pytest.approx(PER_LAYER[1], rel=1e-9)


def test_an_incomplete_bit_width_is_left_out_with_its_reason():
    records = [r for r in fingerprint_records({16: 1.0, 4: 0.5})
               if not (r["bits"] == 4 and r["num_layers"] > 1)]  # W4 profiling cut short
    fits = estimate.fit_records(records, 30, EMBEDDING)
    assert "cannot be fitted" in fits.covers(space.Configuration(4, 1, 1))
    assert fits.covers(space.Configuration(16, 3, 2)) is None


# ---- shared layouts (profile --layouts-at) and streamed timing -----------------------------


def test_layouts_at_runs_the_layouts_at_one_bit_width_only():
    runs = [(c.name, n) for c, n in cli.fingerprint_runs((16, 8, 4), (1, 3), (4, 8), 16)]
    assert runs == [("W16-TP1-PP1", 4), ("W16-TP1-PP1", 8), ("W16-TP1-PP2", 5),
                    ("W16-TP1-PP2", 9), ("W16-TP3-PP1", 4), ("W16-TP3-PP1", 8),
                    ("W8-TP1-PP1", 4), ("W8-TP1-PP1", 8), ("W4-TP1-PP1", 4), ("W4-TP1-PP1", 8)]


def _w8_records(offset_bytes, per_layer_delta_bytes, time_scale, pp2_time_scale=None):
    """W16 at every layout; W8 at TP1/PP1 (and PP 2 when ``pp2_time_scale``), whose processes
    hold ``offset_bytes`` more (own overhead, not sharded) and ``per_layer_delta_bytes`` more
    per layer (sharded over TP), and whose times are W16's times ``time_scale``."""
    records = [r for r in fingerprint_records({16: 1.0})]
    runs = [(space.Configuration(8, 1, 1), n) for n in (1, 2)]
    if pp2_time_scale is not None:
        runs += [(space.Configuration(8, 1, 2), n) for n in (2, 3)]
    for cfg, n in runs:
        r = synthetic_record(8, cfg.tp, cfg.pp, n, 1.0,
                             time_scale if cfg.pp == 1 else pp2_time_scale)
        split = space.stage_layers(n, cfg.pp)
        for p in r["processes"]:
            p["weight_bytes"] += offset_bytes + split[p["pp_rank"]] * per_layer_delta_bytes
        records.append(r)
    return records


def test_a_bit_width_fingerprinted_at_tp1_pp1_borrows_the_reference_layouts():
    offset, delta, scale = 5e6, -4e6, 0.6
    fits = estimate.fit_records(_w8_records(offset, delta, scale), 30, EMBEDDING)
    assert not fits.unfitted
    for tp, pp, batch in itertools.product((1, 3), (1, 2, 3), (1, 4)):
        cfg = space.Configuration(8, tp, pp)
        if space.exclusion_reason(cfg, DEFAULT_CONFIG):
            continue
        assert fits.covers(cfg) is None
        ttft, tpot = fits.latency_of(cfg, batch)
        assert ttft == pytest.approx(scale * true_seconds("ttft", tp, 30, batch, pp), rel=1e-7)
        assert tpot == pytest.approx(scale * true_seconds("tpot", tp, 30, batch, pp), rel=1e-7)
        split = space.stage_layers(30, pp)
        want = sum(tp * (true_process_bytes(tp, pp, s, n) + offset + n * delta / tp)
                   for s, n in enumerate(split))
        assert fits.memory_of(cfg).total_bytes["weight_bytes"] == pytest.approx(want, rel=1e-9)


def test_a_bit_width_keeps_the_pipeline_line_it_measured_itself():
    fits = estimate.fit_records(_w8_records(0.0, 0.0, 0.6, pp2_time_scale=2.0), 30, EMBEDDING)
    ttft, tpot = fits.latency_of(space.Configuration(8, 1, 2), 4)
    assert tpot == pytest.approx(2.0 * true_seconds("tpot", 1, 30, 4, 2), rel=1e-7)
    ttft, tpot = fits.latency_of(space.Configuration(8, 3, 1), 4)  # TP 3 borrowed
    assert tpot == pytest.approx(0.6 * true_seconds("tpot", 3, 30, 4, 1), rel=1e-7)


def test_streamed_timing_gaps_and_workload():
    # Steady 10 ms a token, but the client read in clumps: events at the same instant (gaps of
    # 0 s) and one chunk of 3 tokens. Per-gap, the median would be 0; windows of 8 see 10 ms.
    arrivals = [(0.0, 1)]
    for k in range(2, 41):
        arrivals.append((0.01 * (k - 1) if k % 4 == 1 else arrivals[-1][0], k))
    arrivals.append((0.42, 44))  # one chunk of 3 tokens
    assert measure.windowed_tpot(arrivals, 8) == pytest.approx(0.01, rel=0.15)
    assert measure.windowed_tpot([(0.0, 1), (0.1, 2), (0.4, 5)], 8) == pytest.approx(0.1)
    # One slowed step does not move the median of a long request.
    steady = [(0.01 * k, k + 1) for k in range(64)]
    slowed = steady[:30] + [(t + 0.5, c) for t, c in steady[30:]]
    assert measure.windowed_tpot(slowed) == pytest.approx(0.01, rel=1e-6)
    with pytest.raises(ValueError, match="two tokens"):
        measure.windowed_tpot([(0.0, 1)])
    measure.Workload(128, (64,), (1, 4), 3, 4096, "stream").check_integrity()
    with pytest.raises(ValueError, match="two distinct"):
        measure.Workload(128, (64,), (1, 4), 3, 4096, "e2e").check_integrity()
    with pytest.raises(ValueError, match="timing"):
        measure.Workload(128, (8, 40), (1, 4), 3, 4096, "clock").check_integrity()


def test_streamed_points_take_each_phase_at_its_fastest_repetition():
    record = {"bits": 16, "tp": 1, "pp": 1, "num_layers": 4, "latency": [
        {"batch": 1, "output_tokens": 64, "e2e_s": [2.0, 1.9],
         "ttft_s": [0.30, 0.25], "tpot_s": [0.020, 0.022]}]}
    (point,) = estimate.latency_points([record], 16)
    assert (point.ttft_s, point.tpot_s) == (0.25, 0.020)
