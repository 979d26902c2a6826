"""``python -m sglang_morph.iserve``: iServe's intent-driven deployment.

    python -m sglang_morph.iserve fingerprint                      # build the 1- and 2-layer ones
    python -m sglang_morph.iserve profile --out profile.json [--bits 16] [--append]
    python -m sglang_morph.iserve estimate --profile profile.json --batch 1
    python -m sglang_morph.iserve select --profile profile.json --intent min-latency \\
        --device node0:24GB:2:0.1 --device node1:8GB:2:0.5 --placement hybrid [--launch]

``profile`` serves the fingerprints (TP1/PP1 and TP t/PP1 at 1 and 2 layers, TP1/PP2 at 2
layers, per bit-width) and records their memory and latency; ``--full W16-TP1-PP1,...`` also
measures full configurations (to check the estimates). ``select`` ranks every servable
configuration for the intent, takes the first that is feasible and fits a device, and prints one
``scripts/serve.sh`` command per model (``--launch`` execs it; one model only). Bad input ends
with ``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from sglang_morph.iserve import estimate, intents, placement, space
from sglang_morph.iserve.measure import Workload
from sglang_morph.repo_data import REPO_ROOT
from sglang_morph.cli import CliError, parse_size, run_command
from sglang_morph.config import FULL_PRECISION_BITS

FINGERPRINT_LAYERS = (1, 2)  # the paper's; --layers takes others (see fingerprint_runs)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CliError(f"{flag} {text!r}: expected integers like 1,4") from None
    if not values or min(values) < 1:
        raise CliError(f"{flag} {text!r}: expected positive integers")
    return values


def _size(text: str, flag: str) -> int:
    try:
        return parse_size(text)
    except CliError as e:
        raise CliError(f"{flag}: {e}") from None


def _model_and_engines(args) -> tuple[Path, Path | None]:
    from sglang_morph.models import default_model_path
    from sglang_morph.cli import default_engines

    model_dir = Path(args.model_path) if args.model_path else default_model_path()
    if not (model_dir / "config.json").is_file():
        raise CliError(f"--model-path {model_dir}: no config.json there")
    if args.engines == "none":
        return model_dir, None
    return model_dir, Path(args.engines) if args.engines else default_engines(model_dir)


# ---- fingerprint --------------------------------------------------------------------------


def cmd_fingerprint(args) -> dict:
    from sglang_morph.iserve.fingerprint import make_fingerprint

    model_dir, engines = _model_and_engines(args)
    out = []
    for n in _ints(args.layers, "--layers"):
        try:
            fp = make_fingerprint(model_dir, engines, n)
        except (ValueError, FileNotFoundError) as e:
            raise CliError(str(e)) from None
        out.append({"layers": n, "model_dir": str(fp.model_dir),
                    "engines_dir": str(fp.engines_dir) if fp.engines_dir else None})
    return {"fingerprints": out}


# ---- profile ------------------------------------------------------------------------------


def fingerprint_runs(bits: tuple[int, ...], tp_sizes: tuple[int, ...],
                     layers: tuple[int, int] = FINGERPRINT_LAYERS,
                     layout_bits: int | None = None) -> list[tuple[space.Configuration, int]]:
    """(configuration, fingerprint layers) of M2 and L2: TP1/PP1 and TP t/PP1 at ``layers``
    (1 and 2), TP1/PP2 at one layer more each (2 and 3: a 1-layer model has no second stage;
    ``estimate`` says why PP needs two depths of its own). With ``layout_bits`` only that
    bit-width runs the TP t and PP 2 fingerprints; the others run TP1/PP1 alone and
    ``estimate`` takes their layouts' terms from it (``estimate.fit_records``)."""
    runs = []
    for b in bits:
        for tp in sorted(set(tp_sizes) | {1}):
            if layout_bits is not None and b != layout_bits and tp != 1:
                continue
            runs += [(space.Configuration(b, tp, 1), n) for n in layers]
            if tp == 1 and (layout_bits is None or b == layout_bits):
                runs += [(space.Configuration(b, 1, 2), n + 1) for n in layers]
    return runs


def cmd_profile(args) -> dict:
    from sglang_morph.iserve.fingerprint import make_fingerprint
    from sglang_morph.iserve.measure import measure_in_server, measure_server
    from sglang_morph.models.spec import ModelSpec

    model_dir, engines = _model_and_engines(args)
    hf_config = json.loads((model_dir / "config.json").read_text())
    workload = Workload(args.prompt, tuple(_ints(args.output, "--output")),
                        _ints(args.batches, "--batches"), args.repetitions, args.kv_tokens,
                        args.timing)
    try:
        workload.check_integrity()
    except ValueError as e:
        raise CliError(str(e)) from None
    bits = _ints(args.bits, "--bits")
    tp_sizes = _ints(args.tp, "--tp")
    layers = _ints(args.layers, "--layers")
    layout_bits = None
    if args.layouts_at is not None:
        # Not necessarily among --bits: `--bits 8,4 --layouts-at 16 --append` adds the W8/W4
        # TP1/PP1 fingerprints to a profile whose 16-bit session ran every layout.
        if args.layouts_at not in space.BITS:
            raise CliError(f"--layouts-at {args.layouts_at}: expected one of {space.BITS}")
        layout_bits = args.layouts_at
    if len(set(layers)) != 2 or max(layers) >= hf_config["num_hidden_layers"]:
        raise CliError(f"--layers needs two distinct fingerprint depths below the model's "
                       f"{hf_config['num_hidden_layers']} layers, got {args.layers!r}")
    full = [_parse_config(c) for c in args.full.split(",") if c.strip()] if args.full else []
    for cfg in [space.Configuration(b, t, 1) for b in bits for t in tp_sizes] + full:
        reason = space.exclusion_reason(cfg, hf_config)
        if reason:
            raise CliError(f"{cfg.name}: {reason}")
        if cfg.bits != 16 and engines is None:
            raise CliError(f"{cfg.name} needs --engines with {cfg.bits}-bit variants")
    out_path = Path(args.out)
    if args.append and out_path.is_file():
        profile = json.loads(out_path.read_text())
        if profile["model_dir"] != str(model_dir):
            raise CliError(f"--append: {out_path} profiles {profile['model_dir']}")
    else:
        spec = ModelSpec.from_hf_config(hf_config)
        profile = {"model_dir": str(model_dir), "engines_dir": str(engines) if engines else None,
                   "num_layers": hf_config["num_hidden_layers"],
                   "embedding_bytes": spec.embedding_bytes,
                   "workload": json.loads(json.dumps(dataclasses.asdict(workload))),
                   "sessions": [], "records": []}
    if profile["workload"] != json.loads(json.dumps(dataclasses.asdict(workload))):
        raise CliError(f"--append: {out_path} was profiled with workload {profile['workload']}")
    session = {"started_unix_s": time.time(), "uptime": _uptime(), "git": git_commit(),
               "argv": sys.argv}
    # A SIGTERM (e.g. `timeout`) must still stop the server being measured: by default it
    # ends Python without running `finally`, and the server outlived two cut-short runs here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = Path(args.log_dir)
    jobs = [] if args.skip_fingerprints else [
        (cfg, n, "fingerprint") for cfg, n in fingerprint_runs(bits, tp_sizes, layers,
                                                               layout_bits)]
    if args.only:
        only = {item.strip() for item in args.only.split(",") if item.strip()}
        jobs = [j for j in jobs if f"{j[0].name}@{j[1]}" in only]
        if not jobs:
            raise CliError(f"--only {args.only!r} names no fingerprint run of --bits/--tp "
                           f"(e.g. W16-TP1-PP1@2)")
    if args.tp_pp and not args.in_server:
        raise CliError("--tp-pp adds a launch to --in-server profiling; give --in-server")
    if args.in_server:
        if args.only:
            raise CliError("--only re-measures fingerprint servers; --in-server has one per "
                           "layout")
        for (tp, pp), bit_runs in in_server_launches(jobs, tp_pp=args.tp_pp).items():
            print(f"profile: in one server, TP {tp} x PP {pp}: {bit_runs}", file=sys.stderr,
                  flush=True)
            records = measure_in_server(tp, pp, model_dir, engines, bit_runs, workload,
                                        log_dir / f"in-server-TP{tp}-PP{pp}.log")
            for record in records:
                add_record(profile, record, session["git"])
            out_path.write_text(json.dumps(profile, indent=1))
        jobs = []
    jobs += [(cfg, hf_config["num_hidden_layers"], "full") for cfg in full]
    for cfg, n, kind in jobs:
        if kind == "fingerprint":
            fp = make_fingerprint(model_dir, engines, n)
            served_model, served_engines = fp.model_dir, fp.engines_dir
        else:
            served_model, served_engines = model_dir, engines
        print(f"profile: {kind} {cfg.name} at {n} layer(s)", file=sys.stderr, flush=True)
        record = measure_server(cfg, served_model, served_engines, n, workload,
                                log_dir / f"{kind}-{cfg.name}-{n}l.log", kind)
        add_record(profile, record, session["git"])
        out_path.write_text(json.dumps(profile, indent=1))  # a crash keeps what was measured
    session["ended_unix_s"] = time.time()
    session["uptime_at_end"] = _uptime()
    profile["sessions"].append(session)
    out_path.write_text(json.dumps(profile, indent=1))
    return {"out": str(out_path), "records": len(profile["records"]),
            "cpu_s": {k: sum(r["cpu_s"] for r in profile["records"] if r["kind"] == k)
                      for k in ("fingerprint", "full")}}


def in_server_launches(jobs: list[tuple[space.Configuration, int, str]], tp_pp: bool = False
                       ) -> dict[tuple[int, int], list[tuple[int, list[int]]]]:
    """The fingerprint runs of ``jobs`` as ``profile --in-server`` measures them: one launch
    per layout (TP, PP), in it each bit-width's depths. ``tp_pp``: one more launch per TP
    size t > 1, 16 bits at TP t x PP 2 at the PP 2 depths (the only bit-width SGLang serves
    there), so that L2 fits those layouts instead of adding TP 1's pipeline hops to TP t."""
    launches: dict[tuple[int, int], dict[int, list[int]]] = {}
    for cfg, n, _ in jobs:
        launches.setdefault((cfg.tp, cfg.pp), {}).setdefault(cfg.bits, []).append(n)
    if tp_pp:
        pp_depths = sorted({n for cfg, n, _ in jobs if cfg.pp == 2})
        for tp in sorted({cfg.tp for cfg, _, _ in jobs if cfg.tp > 1}):
            launches[(tp, 2)] = {FULL_PRECISION_BITS: pp_depths}
    return {layout: [(b, sorted(ns)) for b, ns in sorted(by_bits.items(), reverse=True)]
            for layout, by_bits in launches.items()}


def add_record(profile: dict, record: dict, git: str | None) -> None:
    # Every record names its code: a session cut short (a timeout) records no session.
    record["git"] = git
    # A new measurement of the same point replaces the old one (a re-run on a quieter
    # machine), so the fits never mix two measurements of one point.
    key = (record["kind"], record["config"], record["num_layers"])
    profile["records"] = [r for r in profile["records"]
                          if (r["kind"], r["config"], r["num_layers"]) != key] + [record]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                         text=True)
    return out.stdout.strip() or None


def _parse_config(text: str) -> space.Configuration:
    try:
        return space.Configuration.parse(text)
    except ValueError as e:
        raise CliError(str(e)) from None


# ---- estimate -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Profile:
    path: Path
    raw: dict
    estimates: estimate.ModelEstimates
    hf_config: dict

    @property
    def model_dir(self) -> Path:
        return Path(self.raw["model_dir"])


def load_profile(path: str) -> Profile:
    p = Path(path)
    if not p.is_file():
        raise CliError(f"--profile {path} does not exist (run `python -m sglang_morph.iserve "
                       "profile --out FILE` first)")
    try:
        raw = json.loads(p.read_text())
        records = [r for r in raw["records"] if r["kind"] == "fingerprint"]
        fits = estimate.fit_records(records, raw["num_layers"], raw["embedding_bytes"])
        hf_config = json.loads((Path(raw["model_dir"]) / "config.json").read_text())
    except (KeyError, ValueError, TypeError, json.JSONDecodeError, OSError) as e:
        raise CliError(f"--profile {path} is not a usable profile: {e}") from None
    return Profile(p, raw, fits, hf_config)


def candidates(profile: Profile, batch: int, output_tokens: int, requests: int,
               memory_figure: str, quality: dict[int, float]
               ) -> tuple[list[intents.Candidate], dict[str, str]]:
    """Estimates of every servable configuration, and why each other one is left out."""
    rows, excluded = [], {}
    for cfg in space.space():
        reason = space.exclusion_reason(cfg, profile.hf_config) or profile.estimates.covers(cfg)
        if reason:
            excluded[cfg.name] = reason
            continue
        mem = profile.estimates.memory_of(cfg)
        ttft, tpot = profile.estimates.latency_of(cfg, batch)
        if memory_figure == "rss":
            memory, peak = mem.total_bytes["rss_hwm_bytes"], mem.peak_bytes["rss_hwm_bytes"]
        else:
            memory, peak = mem.accounted_total_bytes, mem.accounted_peak_bytes
        rows.append(intents.Candidate.of(cfg, ttft, tpot, memory, peak, quality.get(cfg.bits),
                                         batch, output_tokens, requests))
    return rows, excluded


def _row(c: intents.Candidate) -> dict:
    return {"config": c.cfg.name, "ttft_s": round(c.ttft_s, 4), "tpot_s": round(c.tpot_s, 5),
            "e2e_s": round(c.e2e_s, 4), "memory_gb": round(c.memory_bytes / 1e9, 4),
            "peak_process_gb": round(c.peak_process_bytes / 1e9, 4),
            "device_hours": round(c.device_hours, 6), "perplexity": c.perplexity}


def cmd_estimate(args) -> dict:
    if len(args.profile) != 1:
        raise CliError("estimate takes one --profile")
    profile = load_profile(args.profile[0])
    rows, excluded = candidates(profile, args.batch, args.output, args.requests,
                                args.memory, intents.perplexity_by_bits())
    return {"model": str(profile.model_dir), "batch": args.batch,
            "estimates": [_row(c) for c in rows], "excluded": excluded}


# ---- select -------------------------------------------------------------------------------


def parse_device(text: str) -> placement.Device:
    """``NAME:MEMORY[:CORES[:LOAD]]``."""
    parts = text.split(":")
    if len(parts) < 2 or len(parts) > 4 or not parts[0]:
        raise CliError(f"--device {text!r}: expected NAME:MEMORY[:CORES[:LOAD]], e.g. "
                       "node0:24GB:2:0.1")
    try:
        cores = int(parts[2]) if len(parts) > 2 else 1
        load = float(parts[3]) if len(parts) > 3 else 0.0
    except ValueError:
        raise CliError(f"--device {text!r}: cores must be an integer and load a number") \
            from None
    device = placement.Device(parts[0], _size(parts[1], f"--device {text!r}"), cores, load)
    try:
        device.check_integrity()
    except ValueError as e:
        raise CliError(str(e)) from None
    return device


def cmd_select(args) -> dict:
    spec = intents.IntentSpec(
        args.intent, args.cost, args.ttft_slo_s, args.tpot_slo_s,
        _size(args.max_memory, "--max-memory") if args.max_memory else None,
        args.max_device_hours, args.max_perplexity)
    try:
        spec.check_integrity()
    except ValueError as e:
        raise CliError(str(e)) from None
    for flag, value in (("--batch", args.batch), ("--output", args.output),
                        ("--requests", args.requests)):
        if value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}")
    cluster = placement.Cluster([parse_device(d) for d in args.device])
    try:
        cluster.check_integrity()
    except ValueError as e:
        raise CliError(str(e)) from None
    profiles = [load_profile(p) for p in args.profile]
    if args.launch and len(profiles) != 1:
        raise CliError("--launch starts one server: give exactly one --profile")
    quality = intents.perplexity_by_bits()
    models = []
    for i, profile in enumerate(profiles):
        rows, excluded = candidates(profile, args.batch, args.output, args.requests,
                                    args.memory, quality)
        ranked = intents.rank(rows, spec)
        chosen = device = None
        table = []
        for c, why in ranked:
            if why is None and chosen is None:
                device = cluster.choose(args.placement, c.memory_bytes, c.cfg.processes,
                                        args.load_threshold)
                if device is None:
                    why = (f"no device has {c.memory_bytes / 1e9:.2f} GB free "
                           f"({args.placement})")
                else:
                    chosen = c
            table.append({**_row(c), "infeasible": why})
        model = {"model": str(profile.model_dir), "ranking": table, "excluded": excluded}
        if chosen is None:
            raise CliError(f"{profile.model_dir.name}: no configuration meets the intent and "
                           f"fits a device; first reasons: "
                           f"{[(r['config'], r['infeasible']) for r in table[:3]]}")
        device_before = device
        cluster.place(device, chosen.memory_bytes, chosen.cfg.processes)
        engines = profile.raw.get("engines_dir")
        argv = space.serve_argv(chosen.cfg, profile.model_dir,
                                Path(engines) if engines else None,
                                profile.raw["workload"]["kv_tokens"],
                                max_running_requests=args.batch,
                                extra=("--port", str(args.port + i)))
        model.update({"chosen": _row(chosen), "device": device_before.name,
                      "device_before": dataclasses.asdict(device_before),
                      "serve": {"argv": argv, "command": " ".join(shlex.quote(a) for a in argv)}})
        models.append(model)
    out = {"intent": dataclasses.asdict(spec), "placement": args.placement,
           "accuracy_limit_note": "extension: the iServe paper has no accuracy intent",
           "models": models, "cluster_after": [dataclasses.asdict(d) for d in cluster.devices]}
    for m in models:
        print(f"# {Path(m['model']).name} on {m['device']}: {m['chosen']['config']}",
              file=sys.stderr)
        print(m["serve"]["command"], file=sys.stderr, flush=True)
    if args.launch:
        argv = models[0]["serve"]["argv"]
        os.execvp(argv[0], argv)
    return out


# ---- main ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_morph.iserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_flags(p):
        p.add_argument("--model-path", help="HF model directory (default: the embedded model)")
        p.add_argument("--engines", help="built W8/W4 variants (default: built or reused in "
                       "the cache); 'none' for 16 bits only")

    p = sub.add_parser("fingerprint", help="build the truncated models and engines")
    model_flags(p)
    p.add_argument("--layers", default="1,2")
    p = sub.add_parser("profile", help="serve and measure the fingerprints")
    model_flags(p)
    p.add_argument("--out", required=True)
    p.add_argument("--append", action="store_true", help="add records to --out")
    p.add_argument("--bits", default="16,8,4")
    p.add_argument("--tp", default="1,3", help="TP sizes to profile (1 is always profiled)")
    p.add_argument("--full", help="full configurations to measure too, e.g. W16-TP1-PP1")
    p.add_argument("--skip-fingerprints", action="store_true", help="measure --full only")
    p.add_argument("--only", help="re-measure only these fingerprint runs, e.g. W16-TP1-PP1@2")
    p.add_argument("--layers", default="1,2", help="the two fingerprint depths (PP 2 runs "
                   "one layer more each)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", default="8,40", help="the two output lengths of L2")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--timing", choices=("e2e", "stream"), default="e2e",
                   help="e2e: end-to-end times at two output lengths; stream: each token's "
                   "arrival (TTFT, median TPOT; one output length is enough)")
    p.add_argument("--in-server", action="store_true",
                   help="fingerprints inside one server per layout: the full model launched "
                   "once per TP x PP, each depth set at runtime (POST /iserve/depth) and each "
                   "bit-width swapped in (POST /morph/swap); latency only")
    p.add_argument("--tp-pp", action="store_true",
                   help="with --in-server: one more launch, 16 bits at TP t x PP 2 (TP x PP "
                   "is otherwise estimated from TP t plus TP 1's pipeline hops)")
    p.add_argument("--layouts-at", type=int, metavar="BITS",
                   help="only this bit-width runs the TP t and PP 2 fingerprints; the others "
                   "run TP1/PP1 and borrow its layout terms (e.g. 16)")
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--log-dir", default="/tmp/sglang-morph-deploy-logs")

    def workload_flags(p):
        p.add_argument("--profile", required=True, action="append")
        p.add_argument("--batch", type=int, default=1, help="requests served together")
        p.add_argument("--output", type=int, default=32, help="new tokens per request")
        p.add_argument("--requests", type=int, default=1000, help="requests (device-hours)")
        p.add_argument("--memory", choices=("rss", "accounted"), default="rss",
                       help="memory figure: RSS high-water mark, or weights + KV + activations")

    p = sub.add_parser("estimate", help="estimate every configuration from a profile")
    workload_flags(p)
    p = sub.add_parser("select", help="choose, place and print (or --launch) the serve command")
    workload_flags(p)
    p.add_argument("--intent", required=True, choices=tuple(intents.INTENTS))
    p.add_argument("--cost", default="memory-x-latency", choices=intents.COSTS)
    p.add_argument("--ttft-slo-s", type=float)
    p.add_argument("--tpot-slo-s", type=float)
    p.add_argument("--max-memory", help="memory budget, e.g. 4GB")
    p.add_argument("--max-device-hours", type=float)
    p.add_argument("--max-perplexity", type=float,
                   help="accuracy limit (an extension the paper lacks)")
    p.add_argument("--device", action="append", required=True,
                   help="NAME:MEMORY[:CORES[:LOAD]], repeated")
    p.add_argument("--placement", default="hybrid", choices=tuple(placement.POLICIES))
    p.add_argument("--load-threshold", type=float, default=0.75)
    p.add_argument("--port", type=int, default=30000, help="first model's port (+1 each)")
    p.add_argument("--launch", action="store_true", help="exec the serve command")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command({"fingerprint": cmd_fingerprint, "profile": cmd_profile,
                        "estimate": cmd_estimate, "select": cmd_select}, args)


if __name__ == "__main__":
    sys.exit(main())
