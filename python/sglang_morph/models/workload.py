"""The offline batch a plan is made for (SplitQuant's setting): ``batch_requests`` prompts of
``prompt_tokens`` each, ``output_tokens`` generated for every one, prefilled in micro-batches of
``prefill_micro_batch`` requests (eta) and decoded in micro-batches of ``decode_micro_batch``
requests (xi)."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Workload:
    batch_requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_micro_batch: int = 1
    decode_micro_batch: int = 1
    page_size: int = 1  # KV pages of the serving engine (tokens)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"Workload.{field.name} must be >= 1, got "
                                 f"{getattr(self, field.name)}")
        for field in ("prefill_micro_batch", "decode_micro_batch"):
            if getattr(self, field) > self.batch_requests:
                raise ValueError(f"Workload.{field} ({getattr(self, field)}) exceeds "
                                 f"batch_requests ({self.batch_requests})")

    @property
    def prefill_micro_batches(self) -> int:
        return math.ceil(self.batch_requests / self.prefill_micro_batch)

    @property
    def decode_micro_batches(self) -> int:
        return math.ceil(self.batch_requests / self.decode_micro_batch)

    @property
    def decode_steps(self) -> int:
        """The first output token comes from the prefill; each further one is a decode step."""
        return self.output_tokens - 1

    @property
    def kv_tokens(self) -> int:
        """KV slots the whole batch holds at its longest, each request rounded up to pages."""
        per_request = math.ceil((self.prompt_tokens + self.output_tokens) / self.page_size)
        return self.batch_requests * per_request * self.page_size

    @property
    def generated_tokens(self) -> int:
        return self.batch_requests * self.output_tokens

    def with_micro_batches(self, prefill: int, decode: int) -> "Workload":
        return dataclasses.replace(self, prefill_micro_batch=prefill, decode_micro_batch=decode)
