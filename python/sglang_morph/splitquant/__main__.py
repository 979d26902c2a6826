"""``python -m sglang_morph.splitquant``: SplitQuant's planner for this repository's layer variants.

    python -m sglang_morph.splitquant profile --out cpu_profile.json      # time W16/W8/W4 layers here
    python -m sglang_morph.splitquant indicator --out omega.json          # omega of every indicator
    python -m sglang_morph.splitquant plan --devices cpu:0.45GB,cpu:0.3GB --cpu-profile cpu_profile.json \\
        --omega omega.json --batch 8 --prompt 128 --output 32 --out plan.json [--serve]
    python -m sglang_morph.splitquant plan --devices T4,V100,A100-40G --model llama-2-13b ...

A plan is printed as JSON (and written to ``--out``) together with one ``scripts/serve.sh``
command. Bad input ends with ``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np

from sglang_morph import models
from sglang_morph.cli import CliError, default_engines, parse_size, run_command
from sglang_morph.repo_data import REPO_ROOT as REPO

BITS = (16, 8, 4)
DEFAULT_OMEGA = REPO / "benchmark/results/splitquant/omega.json"


def _model_and_engines(args) -> tuple[Path, Path]:
    """``--model-dir`` and ``--engines``, or the default model and its W8/W4 variants."""
    model_dir = Path(args.model_dir) if args.model_dir else models.default_model_path()
    return model_dir, Path(args.engines) if args.engines else default_engines(model_dir)


# ---- profile ------------------------------------------------------------------------------


def cmd_profile(args) -> dict:
    from sglang_morph.splitquant import cost, profile

    model_dir, engines = _model_and_engines(args)
    meta = {"load_average_before": profile.load_average(), "threads": args.threads,
            "model": str(model_dir.name), "engines": engines.name}
    points = profile.measure(model_dir, engines, threads=args.threads,
                             repetitions=args.repetitions)
    held_out = profile.measure(model_dir, engines, threads=args.threads,
                               repetitions=args.repetitions, held_out=True)
    meta["load_average_after"] = profile.load_average()
    model = cost.fit("cpu", points, source=f"measured here ({args.threads} thread(s))")
    report = heldout_report(model, held_out)
    out = {**meta, "latency_model": model.to_json(), "held_out_error": report,
           "points": [dataclasses.asdict(p) for p in points],
           "held_out_points": [dataclasses.asdict(p) for p in held_out]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return {"out": args.out, "held_out_error": report}


def heldout_report(model, held_out) -> dict:
    from sglang_morph.splitquant import cost

    report = {}
    for phase in ("prefill", "decode", "head"):
        for bits in BITS:
            pts = [p for p in held_out if p.phase == phase and (p.bits == bits)]
            if pts:
                errors = cost.relative_errors(model, pts)
                report[f"{phase}@{bits}"] = {"mean": float(errors.mean()),
                                             "max": float(errors.max()), "points": len(pts)}
    every = cost.relative_errors(model, held_out)
    report["all"] = {"mean": float(every.mean()), "max": float(every.max()),
                     "points": len(held_out)}
    return report


def load_cpu_latency(path: Path):
    from sglang_morph.splitquant import cost

    if not Path(path).is_file():
        raise CliError(f"--cpu-profile {path} does not exist (run `python -m sglang_morph.splitquant "
                       "profile --out FILE` first)")
    try:
        return cost.LatencyModel.from_json(json.loads(Path(path).read_text())["latency_model"])
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise CliError(f"--cpu-profile {path} is not a profile: {e}") from None


# ---- indicator ----------------------------------------------------------------------------


def cmd_indicator(args) -> dict:
    from sglang_morph.splitquant import indicator

    model_dir, engines = _model_and_engines(args)
    measured = tuple(m for m in args.measured.split(",") if m)
    if set(measured) - set(indicator.MEASURED_INDICATORS):
        raise CliError(f"--measured {args.measured!r}: choose from "
                       f"{','.join(indicator.MEASURED_INDICATORS)}")
    stats, calibration_s = indicator.calibration_stats(model_dir, samples=args.samples)
    results = [indicator.compute(name, engines, stats, BITS, model_dir)
               for name in indicator.INDICATORS]
    if measured:
        # the same calibration windows as the statistics (train split)
        windows = indicator.calibration_windows(model_dir, samples=args.samples)
        results += indicator.compute_measured(measured, engines, model_dir, windows, BITS,
                                              variance=results[0])
    indicator.save(Path(args.out), results, {"calibration_s": calibration_s,
                                             "calibration_samples": args.samples,
                                             "engines": engines.name})
    return {"out": args.out, "calibration_s": calibration_s,
            "compute_s": {r.name: r.compute_s for r in results}}


# ---- plan ---------------------------------------------------------------------------------


def build_problem(args):
    from sglang_morph.splitquant import devices as gpus
    from sglang_morph.splitquant import indicator
    from sglang_morph.models.memory import MemoryModel
    from sglang_morph.models.spec import SIMULATED_MODELS, ModelSpec
    from sglang_morph.splitquant.problem import Cluster, Device, PlanningProblem
    from sglang_morph.splitquant.search import normalized_omega
    from sglang_morph.models.workload import Workload

    try:
        workload = Workload(args.batch, args.prompt, args.output, page_size=args.page_size)
    except ValueError as e:
        raise CliError(str(e)) from None
    model_dir = engines = None
    if args.model in SIMULATED_MODELS:
        model = SIMULATED_MODELS[args.model]
        memory = MemoryModel.from_spec(model, BITS)
    elif args.model == "default":
        from sglang_morph.engines.manifest import EngineManifest

        model_dir, engines = _model_and_engines(args)
        model = ModelSpec.from_model_dir(model_dir)
        # The CPU kernels' layout: what a served stage holds on this machine.
        memory = MemoryModel.from_spec(model, BITS, layout="cpu")
        try:
            EngineManifest.load(engines)
        except Exception as e:  # noqa: BLE001 - any unreadable manifest is the user's input
            raise CliError(f"--engines {engines}: {e}") from None
    else:
        raise CliError(f"unknown --model {args.model!r}; choose 'default' (the served model) or "
                       f"one of {', '.join(SIMULATED_MODELS)}")
    devices = []
    for item in [d for d in args.devices.split(",") if d.strip()]:
        name, _, size = item.strip().partition(":")
        if name == "cpu":
            if model_dir is None:
                raise CliError("cpu devices plan the served model (--model default)")
            if not size:
                raise CliError(f"device {item!r}: a cpu stage needs its memory (cpu:450MB)")
            devices.append(Device("cpu", parse_size(size), load_cpu_latency(args.cpu_profile)))
        else:
            try:
                spec = gpus.gpu(name)
            except ValueError as e:
                raise CliError(str(e)) from None
            memory_bytes = parse_size(size) if size else spec.usable_memory_bytes
            devices.append(Device(name, memory_bytes, gpus.gpu_latency_model(name, model)))
    if not devices:
        raise CliError("--devices is empty")
    if len(devices) > model.num_layers:
        raise CliError(f"{len(devices)} devices for {model.num_layers} layers")
    if args.omega is None and model_dir is not None and DEFAULT_OMEGA.is_file():
        args.omega = str(DEFAULT_OMEGA)
    if args.omega:
        try:
            result = indicator.load(Path(args.omega), args.indicator or _default_indicator(
                Path(args.omega)))
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise CliError(f"--omega {args.omega}: {e}") from None
        if result.omega.shape != (model.num_layers, len(BITS)):
            raise CliError(f"--omega {args.omega} has {result.omega.shape[0]} layers, the model "
                           f"{model.num_layers}")
        omega = result.omega
    else:
        # Without calibration (simulated models): the variance indicator's shape with unit
        # statistics, W8's step 1/127 and W4's 1/15 of the range: omega ~ step^2.
        omega = np.zeros((model.num_layers, 3))
        omega[:, 1], omega[:, 2] = (1 / 127) ** 2, (1 / 15) ** 2
    omega = normalized_omega(omega)
    if not 0 < args.max_omega <= 1:
        raise CliError("--max-omega must be in (0, 1] (share of the all-W4 quality loss)")
    if args.theta < 0:
        raise CliError("--theta must be >= 0")
    try:
        bits = tuple(sorted({int(b) for b in args.bits.split(",")}, reverse=True))
    except ValueError:
        raise CliError(f"--bits {args.bits!r}: expected bit-widths like 16,8,4") from None
    if not bits or not set(bits) <= set(BITS):
        raise CliError(f"--bits {args.bits!r}: choose from {BITS}")
    keep = [BITS.index(b) for b in bits]
    problem = PlanningProblem(model, memory, Cluster(args.cluster_name, tuple(devices)), workload,
                              bits, omega[:, keep], theta_s=0.0, max_omega=args.max_omega)
    from sglang_morph.splitquant.search import reference_time_s

    problem = dataclasses.replace(problem, theta_s=args.theta * reference_time_s(problem))
    return problem, model_dir, engines


def _default_indicator(path: Path) -> str:
    """measured-kl where the file has it: the variance indicator misranks layers within a
    bit-width and underrates W4 against W8 on the served model (docs/splitquant.md)."""
    names = [r["name"] for r in json.loads(Path(path).read_text())["indicators"]]
    return "measured-kl" if "measured-kl" in names else "variance"


def serve_command(plan: dict, kv_bytes_per_token_per_layer: int,
                  engines: Path | None) -> tuple[list[str], dict[str, str]]:
    """The serve.sh argv and environment for a plan (``PlanResult.to_json()``, a baseline's
    too): pipeline stages, the precision map, each stage's weights + KV budget."""
    stage_layers, bits = plan["stage_layers"], plan["layer_bits"]
    stage_memory, workload = plan["stage_memory"], plan["workload"]
    argv = [str(REPO / "scripts/serve.sh")]
    env = {}
    pp = len(stage_layers)
    if pp > 1:
        argv += ["--pp-size", str(pp)]
        env["SGLANG_PP_LAYER_PARTITION"] = ",".join(str(n) for n in stage_layers)
    if any(b != 16 for b in bits):
        items, start = [], 0
        for l in range(1, len(bits) + 1):
            if l == len(bits) or bits[l] != bits[start]:
                span = f"{start}" if l - 1 == start else f"{start}-{l - 1}"
                items.append(f"{span}:{bits[start]}")
                start = l
        argv += ["--enable-morph", "--morph-engines", str(engines or "ENGINES_DIR"),
                 "--morph-precision-map", ",".join(items), "--disable-morph-controller"]
        # each stage's weights + KV budget (every stage keeps the tightest one's KV capacity)
        if pp == 1:
            argv += ["--morph-memory-budget", str(stage_memory[0]["budget_bytes"])]
        else:
            argv += ["--morph-stage-budgets",
                     ",".join(str(m["budget_bytes"]) for m in stage_memory)]
    else:  # SGLang sizes one KV pool per stage with the same token count: the plan's smallest
        kv_tokens = min(m["kv_bytes"] // max(1, n * kv_bytes_per_token_per_layer)
                        for m, n in zip(stage_memory, stage_layers))
        argv += ["--max-total-tokens", str(int(kv_tokens))]
    argv += ["--max-running-requests", str(workload["batch_requests"])]
    if pp > 1:
        argv += ["--pp-max-micro-batch-size", str(workload["decode_micro_batch"])]
    return argv, env


def cmd_plan(args) -> dict:
    from sglang_morph.splitquant import baselines
    from sglang_morph.splitquant.search import search

    problem, _model_dir, engines = build_problem(args)
    if args.group_size < 1:
        raise CliError("--group-size must be >= 1")
    result = search(problem, args.solver, group_size=args.group_size,
                    time_limit_s=args.time_limit)
    if result is None:
        raise CliError("no plan fits: every layer at the lowest bit-width still exceeds some "
                       "device's memory (or the quality bound); add memory or devices")
    out = {"model": problem.model.name, "cluster": [d.name for d in problem.cluster.devices],
           "device_memory_bytes": [d.memory_bytes for d in problem.cluster.devices],
           "theta_s": problem.theta_s, "max_omega": problem.max_omega,
           "plan": result.to_json()}
    if args.baselines:
        out["baselines"] = {}
        for name in baselines.BASELINES:
            b = getattr(baselines, name)(problem)
            out["baselines"][name] = None if b is None else b.to_json()
    argv, env = serve_command(out["plan"], problem.model.kv_bytes_per_token_per_layer(),
                              engines)
    out["serve"] = {"argv": argv, "env": env,
                    "command": " ".join([f"{k}={v}" for k, v in env.items()]
                                        + [shlex.quote(x) for x in argv])}
    Path(args.out).write_text(json.dumps(out, indent=1)) if args.out else None
    if args.serve:
        print(out["serve"]["command"], file=sys.stderr, flush=True)
        os.execvpe(argv[0], argv, {**os.environ, **env})
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_morph.splitquant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="time one layer at W16/W8/W4 here and fit the cost model")
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir")
    p.add_argument("--engines")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repetitions", type=int, default=5)
    p = sub.add_parser("indicator", help="omega per layer and bit-width (three indicators)")
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir")
    p.add_argument("--engines")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--measured", default="measured-kl,measured-nll,variance-calibrated",
                   help="indicators measured with model runs on the calibration windows "
                        "(comma-separated; empty for none)")
    p = sub.add_parser("plan", help="plan bit-widths and stages; print JSON and a serve command")
    p.add_argument("--devices", required=True,
                   help="comma-separated stages: GPU names (T4, V100, A100-40G, A100-80G, L4, "
                        "H100, optionally NAME:MEMORY) or cpu:MEMORY")
    p.add_argument("--model", default="default")
    p.add_argument("--model-dir")
    p.add_argument("--engines")
    p.add_argument("--cpu-profile", default=str(REPO / "benchmark/results/splitquant/"
                                                "cpu_profile.json"))
    p.add_argument("--omega", help="indicator file from `splitquant indicator` (default for the "
                   "served model: benchmark/results/splitquant/omega.json)")
    p.add_argument("--indicator", help="which indicator of the --omega file (default: "
                   "measured-kl where it has one, else variance)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--bits", default="16,8,4", help="bit-widths the plan may use")
    p.add_argument("--theta", type=float, default=0.1,
                   help="seconds of the reference time one all-W4 quality loss is worth")
    p.add_argument("--max-omega", type=float, default=0.5,
                   help="quality bound: at most this share of the all-W4 omega")
    p.add_argument("--solver", choices=("ilp", "heuristic"), default="ilp")
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--baselines", action="store_true")
    p.add_argument("--cluster-name", default="cluster")
    p.add_argument("--out")
    p.add_argument("--serve", action="store_true", help="exec the serve command")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command({"profile": cmd_profile, "indicator": cmd_indicator, "plan": cmd_plan},
                       args)


if __name__ == "__main__":
    sys.exit(main())
