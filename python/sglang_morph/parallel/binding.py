"""Which CPU cores each rank of a multi-rank CPU server uses (``SGLANG_CPU_OMP_THREADS_BIND``).

SGLang reads one entry per rank on a node (``|``-separated, indexed by the rank's local device
id; an entry is a core list such as ``0-3`` or ``0,2``). Without the variable SGLang gives each
rank a whole NUMA node and refuses more ranks than nodes, so a 2-core, 1-node machine cannot
start TP 2. ``default_bind`` splits the cores this process may run on between the node's ranks:
contiguous blocks when there are at least as many cores as ranks, otherwise one core each,
round robin (ranks then share cores, which is slower but correct).

``python -m sglang_morph.parallel.binding -- <launch_server args>`` prints that default for the
given ``--tp-size/--pp-size/--dp-size/--nnodes``, or nothing for a single-rank server;
``scripts/serve.sh`` exports it when the user did not set the variable.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence


def parse_core_list(entry: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; a ValueError names the entry when it is malformed."""
    cores: list[int] = []
    for part in entry.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-", 1))
                if last < first:
                    raise ValueError
                cores.extend(range(first, last + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(f"bad core list {entry!r}: expected items like 0-3 or 5, "
                             f"separated by commas") from None
    if any(core < 0 for core in cores) or len(set(cores)) != len(cores):
        raise ValueError(f"bad core list {entry!r}: negative or repeated cores")
    return cores


def format_core_list(cores: Sequence[int]) -> str:
    """The shortest ``a-b,c`` form of sorted, distinct ``cores``."""
    runs: list[str] = []
    start = prev = None
    for core in sorted(cores):
        if prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = core
    if start is not None:
        runs.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(runs)


def default_bind(local_ranks: int, cores: Sequence[int]) -> str:
    """One entry per rank: equal contiguous blocks of ``cores`` (the remainder stays unused so
    every rank runs the same number of threads and none waits for a bigger sibling), or one
    core per rank, round robin, when ranks outnumber cores."""
    if local_ranks < 1 or not cores:
        raise ValueError(f"need at least one rank and one core, got {local_ranks} and {cores}")
    cores = sorted(cores)
    if local_ranks <= len(cores):
        block = len(cores) // local_ranks
        entries = [cores[i * block:(i + 1) * block] for i in range(local_ranks)]
    else:
        entries = [[cores[i % len(cores)]] for i in range(local_ranks)]
    return "|".join(format_core_list(entry) for entry in entries)


def ranks_per_node(tp_size: int, pp_size: int, dp_size: int, nnodes: int) -> int:
    """Scheduler processes one node runs: the whole dp x tp x pp grid spread over the nodes."""
    return math.ceil(dp_size * tp_size * pp_size / nnodes)


def _parser() -> argparse.ArgumentParser:
    # Same option strings as SGLang's ServerArgs; everything else is ignored.
    # No -h: serve.sh passes the user's arguments, and its --help belongs to launch_server.
    parser = argparse.ArgumentParser(prog="python -m sglang_morph.parallel.binding",
                                     add_help=False)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    return parser


def _sizes(argv: Sequence[str] | None) -> tuple[int, int, int, int]:
    """``(tp, pp, dp, nnodes)`` of launch_server arguments (others ignored); a ValueError when
    one is below 1."""
    args, _ = _parser().parse_known_args(argv)
    sizes = (args.tp_size, args.pp_size, args.dp_size, args.nnodes)
    if min(sizes) < 1:
        raise ValueError("--tp-size, --pp-size, --dp-size and --nnodes must be >= 1")
    return sizes


def local_ranks(argv: Sequence[str]) -> int:
    """Scheduler processes one node runs for launch_server arguments ``argv``."""
    return ranks_per_node(*_sizes(argv))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        sizes = _sizes(argv)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tp_size, pp_size, dp_size, _nnodes = sizes
    if tp_size * pp_size * dp_size > 1:
        print(default_bind(ranks_per_node(*sizes), sorted(os.sched_getaffinity(0))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
