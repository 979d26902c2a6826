"""Test-only fault injection into the steps of a runtime transition.

``SGLANG_MORPH_FAULT=<step>[:<count>][,<step>[:<count>]...]`` in the environment of a server
makes the named steps raise ``InjectedFault`` the next ``count`` times (default 1) they run
after the scheduler finished its startup. Steps, in the order a transition runs them:

- ``down``: installing quantized variants (raised before the last linear of the action is
  switched, so every other linear already is);
- ``grow``: growing the KV pool (raised after the new buffers are in the pool, before the new
  pages are handed out);
- ``shrink``: shrinking the KV pool (raised after cache eviction and the move of live KV below
  the boundary, before the buffers are cut);
- ``up``: putting full-precision weights back (raised before the last linear is switched);
- AMOEBAs' re-shard of the KV by head (``amoebas/kv_reshard.py``): ``kv_prepare`` (the new
  own layout placed), ``kv_stage`` (a pair's rows staged, before they are sent), ``kv_write``
  (received rows written), ``kv_install`` (the new pools installed); ``ffn_gather`` (a
  split's FFN rows gathered back, before they are written).

Each point is where a real failure would leave the most half-done state behind, which is what
the tests need to show is undone. Off by default: the check is one attribute test when no fault
is armed. Never set this outside tests.
"""

from __future__ import annotations

import contextlib
import os

ENV_VAR = "SGLANG_MORPH_FAULT"
# A MorphServe swap and restore, and the core's KV resizer (every mechanism's grow and shrink).
RUNTIME_STEPS = ("down", "grow", "shrink", "up")
# AMOEBAs' merge and split of a group.
GROUP_STEPS = ("kv_prepare", "kv_stage", "kv_write", "kv_install", "ffn_gather")
STEPS = RUNTIME_STEPS + GROUP_STEPS


class InjectedFault(RuntimeError):
    """Raised by an armed fault point (tests only)."""


def parse_spec(spec: str) -> dict[str, int]:
    """``"down:2,up"`` -> ``{"down": 2, "up": 1}``; ValueError naming the bad item."""
    armed: dict[str, int] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        step, _, count = item.partition(":")
        if step not in STEPS or (count and not count.isdigit()):
            raise ValueError(f"{ENV_VAR}: cannot parse {item!r}; expected <step>[:<count>] "
                             f"with a step from {STEPS}")
        armed[step] = int(count) if count else 1
    return armed


class FaultInjector:
    """Fault points of one runtime. Disarmed until ``arm`` (the runtime arms it from the
    environment once its startup transitions are done, so they are never the ones that fail)."""

    def __init__(self) -> None:
        self._armed: dict[str, int] = {}
        self._suppressed = False

    def arm(self, spec: str | None) -> None:
        self._armed = parse_spec(spec) if spec else {}

    def arm_from_env(self) -> None:
        self.arm(os.environ.get(ENV_VAR))

    @property
    def armed(self) -> dict[str, int]:
        return dict(self._armed)

    def check(self, step: str) -> None:
        """Raise ``InjectedFault`` when ``step`` is armed (and count one firing)."""
        if not self._armed or self._suppressed:
            return
        left = self._armed.get(step, 0)
        if left <= 0:
            return
        self._armed[step] = left - 1
        raise InjectedFault(f"fault injected into step {step!r} ({ENV_VAR}, tests only)")

    @contextlib.contextmanager
    def suppressed(self):
        """No fault fires inside: undoing a failed step must not be failed on purpose too."""
        previous, self._suppressed = self._suppressed, True
        try:
            yield
        finally:
            self._suppressed = previous

