"""The one live memory budget of a morphing server: weights + KV cache.

Every swap and every KV resize goes through it, so the budget is always a number measured after
the last transition, never one computed once at startup.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """Invariant (``check_integrity``): ``weight_bytes + kv_bytes <= total_bytes``.

    ``free_bytes`` is what a swap freed and the KV pool has not taken yet (less than one page
    of KV after a grow), or what a shrink gave back for a restore to take.
    """

    total_bytes: int
    weight_bytes: int
    kv_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.weight_bytes - self.kv_bytes

    def moved(self, weight_delta_bytes: int = 0, kv_delta_bytes: int = 0) -> "MemoryBudget":
        """The budget after weights and KV changed by these deltas; ValueError if over budget."""
        after = dataclasses.replace(
            self,
            weight_bytes=self.weight_bytes + weight_delta_bytes,
            kv_bytes=self.kv_bytes + kv_delta_bytes,
        )
        after.check_integrity()
        return after

    def check_integrity(self) -> None:
        if min(self.total_bytes, self.weight_bytes, self.kv_bytes) < 0 or self.free_bytes < 0:
            raise ValueError(
                f"memory budget exceeded: weights {self.weight_bytes} + KV {self.kv_bytes} bytes "
                f"> budget {self.total_bytes} bytes"
            )
