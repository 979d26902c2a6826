"""``--enable-kunserve``: its flags, its frozen config and the launch checks.

The config is resolved in the launcher (``ServerArgs.from_cli_args``), before anything is
spawned, and rides the ``ServerArgs`` record into every scheduler process, like the morph
config. The rendezvous ports of the groups' gloo links are picked there too (consecutive free
ports on 127.0.0.1, one per group), so every replica reads the same ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from sglang_morph.config import ConfigError, is_int
from sglang_morph.kunserve.controller import ControllerConfig
from sglang_morph.server.ports import free_late_bind_ports

SERVER_ARGS_ATTR = "_kunserve_live_config"


class KunServeConfigError(ConfigError):
    """A launch KunServe cannot serve; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class AutoControlConfig:
    """``--kunserve-auto``: the controller (``kunserve/controller.py``) drives the transitions.

    ``interval_ms``: how often replica 1 publishes its view to replica 0 and replica 0 decides
    (a decision needs both replicas' queues, so it is no fresher than the last publication);
    ``controller``: the thresholds (``ControllerConfig``, which checks them). The JSON form is
    flat: ``interval_ms`` beside the controller's fields."""

    interval_ms: float = 250.0
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)

    def __post_init__(self) -> None:
        value = self.interval_ms
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and 1 <= value <= 60_000):
            raise ValueError(f"interval_ms must be a number in [1, 60000], got {value!r}")

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON form (what ``--kunserve-auto-config`` takes and /kunserve/status shows)."""
        return {"interval_ms": self.interval_ms, **dataclasses.asdict(self.controller)}

    @classmethod
    def from_json(cls, text: str | None) -> "AutoControlConfig":
        """``--kunserve-auto-config``: a JSON object of some of the fields. Raises
        KunServeConfigError naming the flag and the problem."""
        if text is None:
            return cls()
        flag = "--kunserve-auto-config"
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise KunServeConfigError(f"{flag} is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise KunServeConfigError(f"{flag} must be a JSON object, got {text!r}")
        known = list(cls().as_dict())
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise KunServeConfigError(f"{flag}: unknown fields {unknown}; known: "
                                      f"{', '.join(known)}")
        thresholds = dict(body)
        interval_ms = thresholds.pop("interval_ms", cls.interval_ms)
        try:
            return cls(interval_ms=interval_ms, controller=ControllerConfig(**thresholds))
        except ValueError as e:
            raise KunServeConfigError(f"{flag}: {e}") from e


MAX_MICRO_BATCHES = 16
MAX_GROUP_SIZE = 8  # stages of one pipeline; each a member's link to every other member
MICRO_BATCH_CUTS = ("cost", "tokens")
MERGED_PRIORITIES = ("prefill", "decode")
# A chunk shorter than this spends more of its step on the fixed per-step work (sampling,
# the link's two messages a stage) than on the prompt.
MIN_CHUNK_TOKENS = 16


def _check_group_size(g: Any) -> int:
    """``g`` if it is a group size the live groups serve (else the flag's error)."""
    if not (is_int(g) and 2 <= g <= MAX_GROUP_SIZE):
        raise KunServeConfigError(f"--kunserve-group-size must be an integer in "
                                  f"[2, {MAX_GROUP_SIZE}], got {g!r}")
    return g


@dataclasses.dataclass(frozen=True)
class KunServeLiveConfig:
    enabled: bool = False
    # Replicas per group: G consecutive replicas (G*i .. G*i + G - 1) on one link, any two or
    # more of which drop to one pipeline of as many stages (2: pairs).
    group_size: int = 2
    # TCPStore port of the first group's gloo link; group i uses link_port + i.
    link_port: int | None = None
    auto: AutoControlConfig | None = None  # None: operator-driven only
    # A merged replica's prefill of at least 2 x 64 tokens runs as up to this many
    # micro-batches through the merge's stages (1: never cut).
    micro_batches: int = 4
    # Where a prefill is cut: "cost", into ranges of equal cost under the chunk cost model
    # the replica fits on its own micro-batches (equal tokens until it has one); "tokens",
    # into equal token ranges.
    micro_batch_cuts: str = "cost"
    # While merged, each replica runs at most this many requests (None: SGLang's own cap);
    # the rest wait in its queue. Checked against the replica's cap when it starts.
    merged_max_running: int | None = None
    # While merged, each replica prefills at most this many tokens a step and runs its
    # decodes in the same step (SGLang's mixed chunked prefill; None: as launched).
    merged_chunked_prefill: int | None = None
    # While merged, whose forward goes first when another member's cut prefill is running
    # through this replica's layers: "prefill", it finishes before this replica's next
    # forward (the queue a drop is for is served soonest); "decode", this replica's forwards
    # go between its micro-batches (its running requests keep decoding).
    merged_priority: str = "prefill"
    # While merged, a replica with running requests starts a prefill only after at least this
    # many decode steps since its last one (None: whenever SGLang admits a request): its
    # queue waits longer, its running requests decode between the prefills. The first
    # prefill after a drop (the one the drop is for) does not wait.
    merged_prefill_gap_steps: int | None = None

    def __post_init__(self) -> None:
        _check_group_size(self.group_size)
        m = self.micro_batches
        if not (is_int(m) and 1 <= m <= MAX_MICRO_BATCHES):
            raise KunServeConfigError(f"--kunserve-micro-batches must be an integer in "
                                      f"[1, {MAX_MICRO_BATCHES}], got {m!r}")
        if self.micro_batch_cuts not in MICRO_BATCH_CUTS:
            raise KunServeConfigError(f"--kunserve-micro-batch-cuts must be one of "
                                      f"{', '.join(MICRO_BATCH_CUTS)}, got "
                                      f"{self.micro_batch_cuts!r}")
        if self.merged_priority not in MERGED_PRIORITIES:
            raise KunServeConfigError(f"--kunserve-merged-priority must be one of "
                                      f"{', '.join(MERGED_PRIORITIES)}, got "
                                      f"{self.merged_priority!r}")
        for flag, value, least in (
                ("--kunserve-merged-max-running", self.merged_max_running, 1),
                ("--kunserve-merged-chunked-prefill", self.merged_chunked_prefill,
                 MIN_CHUNK_TOKENS),
                ("--kunserve-merged-prefill-gap-steps", self.merged_prefill_gap_steps, 1)):
            if value is not None and not (is_int(value) and value >= least):
                raise KunServeConfigError(f"{flag} must be an integer >= {least}, "
                                          f"got {value!r}")

    def group_port(self, group: int) -> int:
        """The link rendezvous port of group ``group`` (replicas ``G * group`` to
        ``G * group + G - 1``)."""
        return int(self.link_port) + group

    @classmethod
    def from_cli_namespace(cls, args: argparse.Namespace, dp_size: int = 2
                           ) -> "KunServeLiveConfig":
        """``dp_size``: the launch's replicas, ``dp_size / group_size`` groups of them, one link
        port each."""
        auto = bool(getattr(args, "kunserve_auto", False))
        group_size = getattr(args, "kunserve_group_size", None)
        auto_json = getattr(args, "kunserve_auto_config", None)
        micro = getattr(args, "kunserve_micro_batches", None)
        cuts = getattr(args, "kunserve_micro_batch_cuts", None)
        cap = getattr(args, "kunserve_merged_max_running", None)
        chunk = getattr(args, "kunserve_merged_chunked_prefill", None)
        priority = getattr(args, "kunserve_merged_priority", None)
        gap = getattr(args, "kunserve_merged_prefill_gap_steps", None)
        if not getattr(args, "enable_kunserve", False):
            given = [flag for flag, on in (("--kunserve-auto", auto),
                                           ("--kunserve-auto-config", auto_json is not None),
                                           ("--kunserve-micro-batches", micro is not None),
                                           ("--kunserve-micro-batch-cuts", cuts is not None),
                                           ("--kunserve-merged-max-running", cap is not None),
                                           ("--kunserve-merged-chunked-prefill",
                                            chunk is not None),
                                           ("--kunserve-merged-priority",
                                            priority is not None),
                                           ("--kunserve-merged-prefill-gap-steps",
                                            gap is not None),
                                           ("--kunserve-group-size", group_size is not None))
                     if on]
            if given:
                raise KunServeConfigError(f"{', '.join(given)} "
                                          f"{'needs' if len(given) == 1 else 'need'} "
                                          f"--enable-kunserve")
            return cls()
        if auto_json is not None and not auto:
            raise KunServeConfigError("--kunserve-auto-config needs --kunserve-auto")
        group_size = 2 if group_size is None else _check_group_size(group_size)
        # An odd --dp-size is check_launch's to refuse (it names --dp-size, whatever the group).
        if dp_size % group_size and dp_size % 2 == 0:
            raise KunServeConfigError(
                f"--enable-kunserve with --kunserve-group-size {group_size} needs a --dp-size "
                f"that is a multiple of it (got {dp_size}): replicas serve in groups of "
                f"{group_size} consecutive ones")
        groups = max(1, dp_size // group_size)
        port = getattr(args, "kunserve_link_port", None)
        if port is None:
            port = free_late_bind_ports(groups)
            if port is None:
                raise KunServeConfigError(f"--enable-kunserve: no {groups} consecutive free "
                                          f"ports found for the groups' links; pass "
                                          f"--kunserve-link-port")
        return cls(enabled=True, group_size=group_size, link_port=port,
                   auto=AutoControlConfig.from_json(auto_json) if auto else None,
                   **({} if micro is None else {"micro_batches": micro}),
                   **({} if cuts is None else {"micro_batch_cuts": cuts}),
                   merged_max_running=cap, merged_chunked_prefill=chunk,
                   merged_prefill_gap_steps=gap,
                   **({} if priority is None else {"merged_priority": priority}))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sglang-morph KunServe", "Drop replicated layers across data-parallel replicas under "
        "KV overload and serve the pair as a pipeline (POST /kunserve/drop, /kunserve/restore).")
    group.add_argument(
        "--enable-kunserve", action="store_true",
        help="Enable KunServe on an even --dp-size (CPU, torch_native attention): the "
        "/kunserve routes; replicas 2i and 2i + 1 form a pair, which can drop to layers "
        "[0, k) on replica 2i and [k, L) on replica 2i + 1.")
    group.add_argument(
        "--kunserve-group-size", type=int, default=None, metavar="G",
        help="Replicas per group (default 2, pairs): G consecutive replicas on one link, any m "
        "of which (2 <= m <= G) drop together to a pipeline of m stages, each keeping 1/m of "
        "the layers, while the others serve whole (--dp-size a multiple of G; at most "
        f"{MAX_GROUP_SIZE}). Merges of more than two send nothing ahead.")
    group.add_argument(
        "--kunserve-link-port", type=int, default=None, metavar="PORT",
        help="TCP port of the first group's gloo link rendezvous on 127.0.0.1; group i uses "
        "PORT + i (default: consecutive free ports picked at launch).")
    group.add_argument(
        "--kunserve-auto", action="store_true",
        help="Drop and restore automatically: the first replica of each group runs the "
        "KunServe controller on its members' KV use and queues (the POST routes keep working).")
    group.add_argument(
        "--kunserve-auto-config", default=None, metavar="JSON",
        help="The controller's thresholds as a JSON object, e.g. '{\"interval_ms\": 250, "
        "\"drop_persist\": 2, \"restore_usage\": 0.5, \"restore_headroom\": 0.8, "
        "\"restore_persist\": 3, \"min_dwell_s\": 5, \"partial_drop\": true, "
        "\"finishing_steps\": 16, \"pays_prefill_tokens_per_step\": null, "
        "\"pays_counts_arrivals\": true, \"pays_merge_steps\": 0}' (the defaults; "
        "pays_prefill_tokens_per_step 35, the prompt tokens a replica prefills in the time "
        "of a decode step, or \"measured\", each replica's own from its whole forwards, "
        "drops for a queue only when its waits on whole replicas exceed the stall its merged "
        "prefills put on the running requests, counting the requests arriving meanwhile "
        "unless pays_counts_arrivals is false, and pays_merge_steps decode steps of each "
        "running request for the merge itself).")
    group.add_argument(
        "--kunserve-micro-batches", type=int, default=None, metavar="K",
        help="While merged, cut a replica's prefill of at least 128 tokens into up to K "
        "micro-batches (at least 64 tokens each) that flow through the merge's stages "
        f"at once (default {KunServeLiveConfig.micro_batches}; 1: never cut).")
    group.add_argument(
        "--kunserve-micro-batch-cuts", default=None, choices=MICRO_BATCH_CUTS,
        help="Where a merged prefill is cut: 'cost' (default), into ranges of equal cost "
        "under the chunk cost model each replica fits on its own micro-batches (equal tokens "
        "until it has fitted one); 'tokens', into equal token ranges.")
    group.add_argument(
        "--kunserve-merged-max-running", type=int, default=None, metavar="N",
        help="Admission control while merged: each replica runs at most N requests (SGLang's "
        "running-request cap, lowered at a drop and put back at the restore); the rest wait "
        "in its queue. Default: no cap beyond --max-running-requests.")
    group.add_argument(
        "--kunserve-merged-chunked-prefill", type=int, default=None, metavar="TOKENS",
        help="While merged, each replica prefills at most TOKENS tokens a step and runs its "
        "decodes in the same step (SGLang's mixed chunked prefill, set at a drop and put back "
        f"at the restore), so a merged prefill does not stall decodes (at least "
        f"{MIN_CHUNK_TOKENS}). Default: the launch's chunked prefill, not mixed.")
    group.add_argument(
        "--kunserve-merged-priority", default=None, choices=MERGED_PRIORITIES,
        help="While merged, when another member's cut prefill runs through a replica's layers: "
        "'prefill' (default), the replica's next forward waits for its last micro-batch (the "
        "queue a drop is for gets its first tokens soonest); 'decode', the replica's forwards "
        "go between its micro-batches (its running requests keep decoding, the prefill takes "
        "longer).")
    group.add_argument(
        "--kunserve-merged-prefill-gap-steps", type=int, default=None, metavar="N",
        help="Admission pacing while merged: a replica with running requests starts a prefill "
        "only after at least N decode steps since its last one (SGLang's running-request cap, "
        "held at the running count meanwhile); the first prefill after a drop does not wait. "
        "Its queue waits longer, its running requests decode between the prefills. Default: "
        "no pacing.")


def check_launch(server_args: Any, morph_enabled: bool) -> None:
    """Raise KunServeConfigError (one line, naming the flag) for what is not built yet."""
    dp = getattr(server_args, "dp_size", 1) or 1
    if dp < 2 or dp % 2:
        raise KunServeConfigError(
            f"--enable-kunserve needs an even --dp-size of at least 2 (got {dp}): replicas "
            f"serve in groups of two or more (--kunserve-group-size)")
    for name in ("tp_size", "pp_size"):
        if (getattr(server_args, name, 1) or 1) > 1:
            raise KunServeConfigError(f"--enable-kunserve does not support "
                                      f"--{name.replace('_', '-')} > 1 yet")
    if morph_enabled:
        raise KunServeConfigError("--enable-kunserve and --enable-morph together are not "
                                  "supported yet: both resize the same KV pools")
    if str(getattr(server_args, "device", None)) != "cpu":
        raise KunServeConfigError("--enable-kunserve runs on --device cpu only yet (the link "
                                  "sends CPU tensors over gloo)")
    if getattr(server_args, "attention_backend", None) != "torch_native":
        raise KunServeConfigError("--enable-kunserve needs --attention-backend torch_native: "
                                  "the peer's layers run on a torch_native backend over the "
                                  "mirrored KV region")
    if getattr(server_args, "disable_radix_cache", False):
        raise KunServeConfigError("--enable-kunserve needs the radix cache (the KV resizer "
                                  "works on SGLang's device radix cache)")
    if getattr(server_args, "speculative_algorithm", None) is not None:
        raise KunServeConfigError("--enable-kunserve does not support --speculative-algorithm")


def groups(server_args: Any) -> int:
    """The groups of replicas of a launch (``--dp-size / --kunserve-group-size``; at least
    one)."""
    return max(1, (getattr(server_args, "dp_size", 1) or 1) // get(server_args).group_size)


def attach(server_args: Any, cfg: KunServeLiveConfig) -> None:
    setattr(server_args, SERVER_ARGS_ATTR, cfg)


def get(server_args: Any) -> KunServeLiveConfig:
    return getattr(server_args, SERVER_ARGS_ATTR, None) or KunServeLiveConfig()
