"""``--enable-toy``: when a scheduler holds at least ``--toy-requests`` requests (waiting or
running), it records a no-op transition, at most once a second. Nothing in SGLang changes;
everything else (loop, leader, log, metrics, status) is the elastic core's."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from sglang_morph.config import ConfigError
from sglang_morph.elastic.contract import Outcome, Transition
from sglang_morph.elastic.loop import ElasticLoop
from sglang_morph.elastic.record import recorder
from sglang_morph.elastic.registry import Mechanism

SERVER_ARGS_ATTR = "_toy_config"


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    enabled: bool = False
    requests: int = 1


@dataclasses.dataclass(frozen=True)
class Load:
    requests: int
    kv_capacity_tokens: int


@dataclasses.dataclass(frozen=True)
class Noop:
    reason: str


class PressureRule:
    """The controller: a no-op when ``requests`` or more are in the scheduler, then a pause."""

    def __init__(self, requests: int, pause_s: float = 1.0):
        self.requests = requests
        self.pause_s = pause_s
        self._quiet_until_s = 0.0

    def decide(self, load: Load) -> Noop | None:
        if load.requests < self.requests or time.monotonic() < self._quiet_until_s:
            return None
        return Noop(reason=f"{load.requests} requests >= {self.requests}")

    def applied(self, transition: Transition) -> None:
        self._quiet_until_s = time.monotonic() + self.pause_s


class ToyRuntime:
    name = "toy"

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.capacity_at_start = int(scheduler.max_total_num_tokens)
        self.replica = recorder(scheduler).replica

    def observe(self) -> Load:
        s = self.scheduler
        running = len(s.running_batch.reqs) if s.running_batch is not None else 0
        return Load(len(s.waiting_queue) + running, int(s.max_total_num_tokens))

    def apply(self, action: Noop) -> Transition:
        capacity = int(self.scheduler.max_total_num_tokens)
        return Transition(mechanism=self.name, replica=self.replica, action="noop", reason=action.reason,
                          outcome=Outcome.APPLIED, duration_s=0.0,
                          capacity_before_tokens=capacity, capacity_after_tokens=capacity)

    def is_leader(self) -> bool:
        return True

    def state(self) -> dict[str, Any]:
        return {"kv_capacity_tokens": int(self.scheduler.max_total_num_tokens)}

    def check_integrity(self) -> None:
        assert int(self.scheduler.max_total_num_tokens) == self.capacity_at_start


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("toy mechanism", "A no-op transition under pressure.")
    group.add_argument("--enable-toy", action="store_true")
    group.add_argument("--toy-requests", type=int, default=None)


def configure(server_args: Any, args: argparse.Namespace, enabled_before: frozenset[str]) -> bool:
    enabled = bool(getattr(args, "enable_toy", False))
    requests = getattr(args, "toy_requests", None)
    if requests is not None and not enabled:
        raise ConfigError("--toy-requests requires --enable-toy")
    if requests is not None and requests < 1:
        raise ConfigError(f"--toy-requests must be at least 1, got {requests}")
    setattr(server_args, SERVER_ARGS_ATTR, ToyConfig(enabled, requests or 1))
    return enabled


def attach(scheduler: Any):
    cfg = getattr(scheduler.server_args, SERVER_ARGS_ATTR)
    runtime = ToyRuntime(scheduler)
    loop = ElasticLoop(runtime, PressureRule(cfg.requests), recorder(scheduler), interval_s=0.05)
    return loop.on_step, runtime.state


MECHANISM = Mechanism(
    name="toy",
    flag="--enable-toy",
    add_cli_args=add_cli_args,
    configure=configure,
    enabled=lambda server_args: getattr(server_args, SERVER_ARGS_ATTR, ToyConfig()).enabled,
    hooks=lambda: (),
    symbols=lambda: (),
    launcher_setup=lambda server_args: None,
    attach=attach,
    add_routes=lambda app: None,
    transitions_between_batches=False,
)
