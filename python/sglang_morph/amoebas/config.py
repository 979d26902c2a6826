"""``--enable-amoebas``: its flags, its frozen config and the launch checks.

Resolved in the launcher (``ServerArgs.from_cli_args``) before anything is spawned; the config
rides the ``ServerArgs`` record into every scheduler process. The group degrees come from the
model's head counts (read from its ``config.json``) and ``--dp-size``; the base rendezvous port
of the members' gloo links is picked here so every replica reads the same one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from sglang_morph.config import ConfigError
from sglang_morph.server.ports import free_late_bind_ports

SERVER_ARGS_ATTR = "_amoebas_config"
VARIANTS = ("amoebas", "base")
# "batched": a step of every member's batch is one forward of the group (steps.py);
# "per-owner": each owner's batch is its own forward, the owners' forwards interleaved
MERGED_FORWARDS = ("batched", "per-owner")
_PORT_ATTEMPTS = 16


class AmoebasConfigError(ConfigError):
    """A launch AMOEBAs cannot serve; the message names the flag."""


def allowed_degrees(num_q_heads: int, num_kv_heads: int, replicas: int) -> tuple[int, ...]:
    """The group degrees a model allows on ``replicas`` data-parallel replicas: every d that
    divides the KV heads, the query heads and the replica count (1 always)."""
    return tuple(d for d in range(1, replicas + 1)
                 if num_kv_heads % d == 0 and num_q_heads % d == 0 and replicas % d == 0)


def degree_refusal(degree: int, num_q_heads: int, num_kv_heads: int, replicas: int) -> str | None:
    """Why a group of ``degree`` replicas cannot be formed (one line), or None."""
    if degree < 1 or degree > replicas:
        return f"a group of {degree} replicas does not fit {replicas} replicas"
    if num_kv_heads % degree or num_q_heads % degree:
        return (f"a group of {degree} cannot split the model's {num_q_heads} query / "
                f"{num_kv_heads} KV heads evenly (degrees allowed: "
                f"{list(allowed_degrees(num_q_heads, num_kv_heads, replicas))})")
    if replicas % degree:
        return f"groups of {degree} do not tile {replicas} replicas"
    return None


@dataclasses.dataclass(frozen=True)
class AmoebasConfig:
    """Invariant (enabled): ``degrees`` starts with 1, has at least one degree above 1, and
    each divides ``replicas`` and the model's query and KV heads."""

    enabled: bool = False
    replicas: int = 1
    degrees: tuple[int, ...] = (1,)
    link_port: int | None = None  # the first of one TCPStore port per possible group
    auto: bool = True  # merge for a prompt no replica holds, split when done (auto.py)
    # "amoebas": KV by head and FFN released in place; "base": the paper's base variant
    # (token-first KV copied on every transition, FFN shards swapped by copy)
    variant: str = "amoebas"
    merged_forward: str = "batched"
    # How long a merged group's leader waits for the last step's owners (steps.py)
    step_wait_ms: float = 50.0

    def __post_init__(self) -> None:
        if self.merged_forward not in MERGED_FORWARDS:
            raise AmoebasConfigError(f"--amoebas-merged-forward must be one of "
                                     f"{list(MERGED_FORWARDS)}, got {self.merged_forward!r}")
        if not 0 <= self.step_wait_ms <= 1000:
            raise AmoebasConfigError(f"--amoebas-step-wait-ms must be in [0, 1000], got "
                                     f"{self.step_wait_ms}")

    def blocks(self) -> tuple[tuple[int, ...], ...]:
        """Every group the replicas may form: for each degree d > 1, the aligned runs of d
        replicas ``[k*d, (k+1)*d)``; in that order (the order every member builds its links)."""
        return tuple(tuple(range(k * d, (k + 1) * d)) for d in self.degrees if d > 1
                     for k in range(self.replicas // d))

    def degree_chain(self, degree: int) -> tuple[int, ...]:
        """The degrees a group of ``degree`` can be built through, each dividing the next:
        from 1, the largest allowed degree dividing the one above (1, 2, 4 for 4)."""
        chain = [degree]
        while chain[-1] > 1:
            chain.append(max(d for d in self.degrees if d < chain[-1] and chain[-1] % d == 0))
        return tuple(reversed(chain))

    def shard_order(self, block: tuple[int, ...]) -> tuple[int, ...]:
        """The replicas of ``block`` by shard rank (member ``i`` keeps heads and FFN rows
        ``[i*X/d, (i+1)*X/d)``). Ranks nest: in a group of ``d`` built from blocks of
        ``c`` (the next degree down its chain), position ``p`` gets rank ``rank_c(p mod c) *
        (d / c) + p div c``, so every member's shard lies inside its shard in its block of
        ``c`` and two groups merge, or a group splits, without moving an FFN row (for blocks
        of 4 from pairs: replicas 0, 2, 1, 3 in rank order)."""
        block = tuple(block)

        def rank(p: int, chain: tuple[int, ...]) -> int:
            if len(chain) == 1:
                return 0
            below = chain[-2]
            return rank(p % below, chain[:-1]) * (chain[-1] // below) + p // below

        chain = self.degree_chain(len(block))
        ranks = [rank(p, chain) for p in range(len(block))]
        return tuple(block[ranks.index(r)] for r in range(len(block)))

    def sub_blocks(self, block: tuple[int, ...], degree: int) -> tuple[tuple[int, ...], ...]:
        """The allowed blocks of ``degree`` that tile ``block`` (empty when none do)."""
        inside = tuple(b for b in self.blocks() if len(b) == degree and set(b) <= set(block))
        return inside if sum(map(len, inside)) == len(block) else ()

    def block_port(self, block: tuple[int, ...]) -> int:
        return int(self.link_port) + self.blocks().index(tuple(block))

    def board_port(self) -> int:
        """The automatic transitions' board, after the links' ports."""
        return int(self.link_port) + len(self.blocks())

    @classmethod
    def from_cli_namespace(cls, args: argparse.Namespace, server_args: Any) -> "AmoebasConfig":
        if not getattr(args, "enable_amoebas", False):
            given = [f for f, on in (("--amoebas-degrees", args.amoebas_degrees is not None),
                                     ("--amoebas-link-port",
                                      args.amoebas_link_port is not None),
                                     ("--amoebas-manual",
                                      getattr(args, "amoebas_manual", False)),
                                     ("--amoebas-variant",
                                      getattr(args, "amoebas_variant", None) is not None),
                                     ("--amoebas-merged-forward",
                                      getattr(args, "amoebas_merged_forward", None)
                                      is not None),
                                     ("--amoebas-step-wait-ms",
                                      getattr(args, "amoebas_step_wait_ms", None)
                                      is not None)) if on]
            if given:
                raise AmoebasConfigError(f"{', '.join(given)} "
                                         f"{'needs' if len(given) == 1 else 'need'} "
                                         f"--enable-amoebas")
            return cls()
        replicas = getattr(server_args, "dp_size", 1) or 1
        q_heads, kv_heads = model_heads(server_args)
        if args.amoebas_degrees is None:
            degrees = allowed_degrees(q_heads, kv_heads, replicas)
        else:
            degrees = _parse_degrees(args.amoebas_degrees)
            for d in degrees:
                reason = degree_refusal(d, q_heads, kv_heads, replicas)
                if reason is not None:
                    raise AmoebasConfigError(f"--amoebas-degrees {d}: {reason}")
            degrees = tuple(sorted({1, *degrees}))
        if len(degrees) < 2:
            raise AmoebasConfigError(
                f"--enable-amoebas: no group of --dp-size {replicas} replicas can split the "
                f"model's {q_heads} query / {kv_heads} KV heads evenly")
        port = args.amoebas_link_port
        wait_ms = getattr(args, "amoebas_step_wait_ms", None)
        ports_needed = len(cls(True, replicas, degrees, 0).blocks()) + 1
        return cls(enabled=True, replicas=replicas, degrees=degrees,
                   link_port=port if port is not None else _free_ports(ports_needed),
                   auto=not getattr(args, "amoebas_manual", False),
                   variant=getattr(args, "amoebas_variant", None) or "amoebas",
                   merged_forward=getattr(args, "amoebas_merged_forward", None)
                   or cls.merged_forward,
                   step_wait_ms=cls.step_wait_ms if wait_ms is None else wait_ms)


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free now on 127.0.0.1 (for later binds)."""
    first = free_late_bind_ports(count, attempts=_PORT_ATTEMPTS)
    if first is None:
        raise AmoebasConfigError(f"--enable-amoebas: no {count} consecutive free ports found; "
                                 f"pass --amoebas-link-port")
    return first


def _parse_degrees(text: str) -> tuple[int, ...]:
    try:
        degrees = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise AmoebasConfigError(f"--amoebas-degrees must be comma-separated integers, got "
                                 f"{text!r}") from None
    if not degrees:
        raise AmoebasConfigError("--amoebas-degrees is empty")
    return degrees


def model_heads(server_args: Any) -> tuple[int, int]:
    """The model's query and KV head counts, from its ``config.json``."""
    path = Path(getattr(server_args, "model_path", "") or "") / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AmoebasConfigError(f"--enable-amoebas needs the model's config.json: {e}") from e
    hf = hf.get("text_config", hf)
    q = int(hf["num_attention_heads"])
    return q, int(hf.get("num_key_value_heads", q))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sglang-morph AMOEBAs", "Merge data-parallel replicas into one tensor-parallel group "
        "at runtime and split it back (POST /amoebas/merge, /amoebas/split).")
    group.add_argument(
        "--enable-amoebas", action="store_true",
        help="Enable AMOEBAs on --dp-size N (CPU, torch_native attention): replicas serve at "
        "TP 1 and can merge into tensor-parallel groups that split the heads and the FFN.")
    group.add_argument(
        "--amoebas-degrees", default=None, metavar="D[,D...]",
        help="The group sizes allowed (default: every size that divides --dp-size and the "
        "model's query and KV heads; 1 is always allowed).")
    group.add_argument(
        "--amoebas-link-port", type=int, default=None, metavar="PORT",
        help="First TCP port of the groups' gloo links on 127.0.0.1, one port per possible "
        "group and one more for the automatic transitions (default: a free port picked at "
        "launch).")
    group.add_argument(
        "--amoebas-variant", choices=VARIANTS, default=None,
        help="amoebas (default): the KV of each head in its own range, re-sharded by moving "
        "live rows only, and the FFN rows released in place; base: the AMOEBAs paper's base "
        "variant for comparison (token-first KV copied whole on every transition, FFN shards "
        "swapped by copy).")
    group.add_argument(
        "--amoebas-merged-forward", choices=MERGED_FORWARDS, default=None,
        help="batched (default): a merged group runs each step of all its members' batches "
        "as one forward (one pass over the weights and one all-reduce per projection); "
        "per-owner: each member's batch is its own forward of the group, interleaved.")
    group.add_argument(
        "--amoebas-step-wait-ms", type=float, default=None, metavar="MS",
        help="Batched merged forward: how long a group waits, after a member's batch "
        "arrives, for the members of the last step to send theirs (default 50; 0 runs what "
        "has arrived at once).")
    group.add_argument(
        "--amoebas-manual", action="store_true",
        help="No automatic transitions: replicas merge and split only on POST /amoebas/merge "
        "and /amoebas/split (by default a prompt no replica can hold merges the smallest "
        "group that can, and a group splits once its long requests are done and its KV is "
        "at least half free).")


def check_launch(server_args: Any, enabled_before: frozenset[str]) -> None:
    """Raise AmoebasConfigError (one line, naming the flag) for what is not served."""
    dp = getattr(server_args, "dp_size", 1) or 1
    if dp < 2:
        raise AmoebasConfigError(f"--enable-amoebas needs --dp-size of at least 2 (got {dp})")
    for other in ("morph", "kunserve"):
        if other in enabled_before:
            raise AmoebasConfigError(
                f"--enable-amoebas and --enable-{other} together are not supported: both "
                f"resize the same KV pools")
    for name in ("tp_size", "pp_size"):
        if (getattr(server_args, name, 1) or 1) > 1:
            raise AmoebasConfigError(f"--enable-amoebas does not support "
                                     f"--{name.replace('_', '-')} > 1")
    if str(getattr(server_args, "device", None)) != "cpu":
        raise AmoebasConfigError("--enable-amoebas runs on --device cpu only (the links send "
                                 "CPU tensors over gloo)")
    if getattr(server_args, "attention_backend", None) != "torch_native":
        raise AmoebasConfigError("--enable-amoebas needs --attention-backend torch_native")
    if getattr(server_args, "speculative_algorithm", None) is not None:
        raise AmoebasConfigError("--enable-amoebas does not support --speculative-algorithm")


def attach(server_args: Any, cfg: AmoebasConfig) -> None:
    setattr(server_args, SERVER_ARGS_ATTR, cfg)


def get(server_args: Any) -> AmoebasConfig:
    return getattr(server_args, SERVER_ARGS_ATTR, None) or AmoebasConfig()
