"""What one member of a tensor-parallel group of degree d keeps, and how many KV tokens its own
requests may hold.

Every replica has one memory budget: its TP 1 weights plus its startup KV pool. In a group of
degree d a member keeps the attention linears, the embeddings (and an untied LM head), the
norms and the rotary table whole (duplicated: a split then refills the FFN only), and its 1/d
share of every FFN linear along the intermediate dimension (of a padded intermediate size where
the caller pads it so that d divides it). The budget less those weights is the member's KV
memory. It is split into d equal pools: the member's own requests' and one mirror per other
member, each storing the member's ``num_kv_heads / d`` heads of a token. So one pool holds
``(KV memory / d) / (KV bytes per token / d)`` tokens: a member's own requests gain exactly the
KV tokens its freed FFN bytes are worth, and one request must fit one owner's pool.

Plain integers in and out (no SGLang, no torch): the scheduler's policy, its tests and the
simulator under ``benchmark/amoebas/`` use the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the spec module imports torch; these numbers only read its fields
    from sglang_morph.models.spec import ModelSpec

_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def degree_refusal(model: "ModelSpec", degree: int, replicas: int | None = None) -> str | None:
    """Why ``degree`` cannot be a group's degree (one line), or None when it can: it must divide
    the KV heads and the query heads (each member keeps whole heads) and, when ``replicas`` is
    given, not exceed it."""
    heads = (f"the model's {model.num_attention_heads} query / {model.num_kv_heads} KV heads")
    if degree < 1 or model.num_kv_heads % degree or model.num_attention_heads % degree:
        return f"degree {degree} does not divide {heads}"
    if replicas is not None and degree > replicas:
        return f"degree {degree} needs more than the {replicas} replicas"
    return None


@dataclasses.dataclass(frozen=True)
class CapacityModel:
    """Per-degree weights and owner pools of one replica's budget.

    Invariants (``check_integrity``, run on construction): every allowed degree divides its
    intermediate size; the budget holds the TP 1 weights and at least one page per pool at
    every allowed degree; ``owner_capacity_tokens`` never shrinks as the degree grows (a merge
    never leaves a member less room for its own requests than it had).
    """

    model: "ModelSpec"
    replicas: int
    replica_budget_bytes: int
    page_size_tokens: int = 1
    # (degree, padded intermediate size) where the weights are padded so the degree divides it
    padded_intermediate_sizes: tuple[tuple[int, int], ...] = ()
    # (degree, tokens) a live replica reports for its own pool at that degree (what its
    # transition grows the pool to): taken over the formula, so the live dispatcher and the
    # replica cannot disagree by a page
    measured_owner_tokens: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        self.check_integrity()

    @classmethod
    def from_kv_pool(cls, model: "ModelSpec", replicas: int, kv_capacity_tokens_tp1: int,
                     page_size_tokens: int = 1,
                     padded_intermediate_sizes: tuple[tuple[int, int], ...] = (),
                     measured_owner_tokens: tuple[tuple[int, int], ...] = ()
                     ) -> "CapacityModel":
        """The budget of a replica that starts at TP 1 with a pool of ``kv_capacity_tokens_tp1``
        tokens (what ``--max-total-tokens`` gave it)."""
        probe = cls(model, replicas, 1 << 62, page_size_tokens, padded_intermediate_sizes)
        budget = probe.member_weight_bytes(1) + kv_capacity_tokens_tp1 * probe.kv_bytes_per_token
        return cls(model, replicas, budget, page_size_tokens, padded_intermediate_sizes,
                   measured_owner_tokens)

    # ---- degrees ----------------------------------------------------------------------------

    @functools.cached_property  # the policy asks on every decision; the model never changes
    def allowed_degrees(self) -> tuple[int, ...]:
        return tuple(d for d in range(1, self.replicas + 1)
                     if degree_refusal(self.model, d, self.replicas) is None)

    @property
    def max_degree(self) -> int:
        return self.allowed_degrees[-1]

    def refusal(self, degree: int) -> str | None:
        return degree_refusal(self.model, degree, self.replicas)

    def degree_for(self, kv_tokens: int) -> int | None:
        """The smallest allowed degree whose owner pool holds ``kv_tokens``; None: none does."""
        return next((d for d in self.allowed_degrees
                     if self.owner_capacity_tokens(d) >= kv_tokens), None)

    def is_long(self, kv_tokens: int) -> bool:
        """A request that no TP 1 pool can hold: only a merged group serves it."""
        return kv_tokens > self.owner_capacity_tokens(1)

    # ---- bytes ------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """All layers, all KV heads: what one token costs a TP 1 replica."""
        return self.model.num_layers * self.model.kv_bytes_per_token_per_layer()

    def intermediate_size(self, degree: int) -> int:
        return dict(self.padded_intermediate_sizes).get(degree, self.model.intermediate_size)

    def ffn_bytes_per_layer(self, degree: int) -> int:
        """One member's share of one layer's FFN linears (each has the intermediate size as
        one of its two dimensions)."""
        m = self.model
        linears = sum(1 for linear in m.linears if linear.name not in _ATTENTION_LINEARS)
        return linears * m.hidden_size * (self.intermediate_size(degree) // degree) * m.dtype_bytes

    def member_weight_bytes(self, degree: int) -> int:
        """Weights one member keeps in a group of ``degree``: attention, norms, embeddings and
        the rotary table whole, its FFN share."""
        m = self.model
        attention = sum(linear.out_features * linear.in_features for linear in m.linears
                        if linear.name in _ATTENTION_LINEARS) * m.dtype_bytes
        per_layer = attention + m.norm_bytes_per_layer + self.ffn_bytes_per_layer(degree)
        return m.num_layers * per_layer + m.stage_static_bytes(first=True, last=True)

    def freed_bytes(self, degree: int) -> int:
        """FFN bytes a member releases when it joins a group of ``degree`` (refilled on split)."""
        return self.member_weight_bytes(1) - self.member_weight_bytes(degree)

    def member_kv_bytes(self, degree: int) -> int:
        return self.replica_budget_bytes - self.member_weight_bytes(degree)

    def owner_capacity_tokens(self, degree: int) -> int:
        """Tokens one member's own requests may hold in a group of ``degree``: its KV memory
        split into ``degree`` pools of ``KV bytes per token / degree`` each, whole pages."""
        if degree in self._owner_tokens:
            return self._owner_tokens[degree]
        return self._owner_capacity_tokens(degree)

    @functools.cached_property
    def _owner_tokens(self) -> dict[int, int]:
        measured = dict(self.measured_owner_tokens)
        return {d: measured.get(d, self._owner_capacity_tokens(d)) for d in self.allowed_degrees}

    def _owner_capacity_tokens(self, degree: int) -> int:
        pool_bytes = self.member_kv_bytes(degree) // degree
        tokens = pool_bytes // (self.kv_bytes_per_token // degree)
        return tokens // self.page_size_tokens * self.page_size_tokens

    def check_integrity(self) -> None:
        if self.replicas < 1 or self.page_size_tokens < 1:
            raise ValueError(f"capacity model needs replicas and page size >= 1: {self}")
        for degree, size in self.padded_intermediate_sizes:
            if size < self.model.intermediate_size:
                raise ValueError(f"padded intermediate size {size} at degree {degree} is "
                                 f"under the model's {self.model.intermediate_size}")
        previous = 0
        for d in self.allowed_degrees:
            if self.intermediate_size(d) % d:
                raise ValueError(f"degree {d} does not divide the intermediate size "
                                 f"{self.intermediate_size(d)}; pass a padded size")
            tokens = self.owner_capacity_tokens(d)
            if tokens < self.page_size_tokens:
                raise ValueError(f"a budget of {self.replica_budget_bytes} bytes leaves no KV "
                                 f"page per pool at degree {d}")
            if tokens < previous:
                raise ValueError(f"degree {d} leaves a member {tokens} tokens, fewer than "
                                 f"{previous} at a smaller degree (padding too large)")
            previous = tokens
