"""AMOEBAs' capacity model and scheduler policy against hand-built fleets. Pure Python: no
server, no model files (the specs are the models' published shapes)."""

from __future__ import annotations

import itertools
import random

import pytest

from sglang_morph.amoebas.capacity import CapacityModel, degree_refusal
from sglang_morph.amoebas.policy import (
    AmoebasPolicy,
    Dispatch,
    Fleet,
    Merge,
    MergeOnDemand,
    Queue,
    Refuse,
    Request,
    Split,
    Unit,
    UnitRequest,
    UnitState,
)
from sglang_morph.models.spec import ModelSpec

# SmolLM2-135M's config.json (the default model) and the tiny random Llama's shapes.
SMOLLM2 = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192}
TINY = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
        "vocab_size": 49152, "tie_word_embeddings": False, "max_position_embeddings": 4096}
DEFAULT = ModelSpec.from_hf_config(SMOLLM2, "smollm2", dtype_bytes=4)
TINY_SPEC = ModelSpec.from_hf_config(TINY, "tiny", dtype_bytes=4)


def default_capacity(replicas: int = 8, pool: int = 4096) -> CapacityModel:
    return CapacityModel.from_kv_pool(DEFAULT, replicas, pool)


def tiny_capacity(replicas: int = 4, pool: int = 2048) -> CapacityModel:
    return CapacityModel.from_kv_pool(TINY_SPEC, replicas, pool)


def unit(capacity: CapacityModel, members, requests=(), transitioning=False) -> Unit:
    """A unit whose token counts are its requests' (member, kv_tokens, long, admitted)."""
    members = tuple(members)
    reqs = tuple(UnitRequest(f"r{members[0]}-{k}", m, t, long, admitted)
                 for k, (m, t, long, admitted) in enumerate(requests))
    per = [(sum(r.kv_tokens for r in reqs if r.member == m and r.admitted),
            sum(r.kv_tokens for r in reqs if r.member == m and not r.admitted))
           for m in members]
    pool = capacity.owner_capacity_tokens(len(members))
    return Unit(members, len(members), (pool,) * len(members), tuple(u for u, _ in per),
                tuple(q for _, q in per), reqs, transitioning)


def singles(capacity: CapacityModel, used: dict[int, int]) -> list[Unit]:
    return [unit(capacity, (m,), [(m, t, False, True)] if t else [])
            for m, t in sorted(used.items())]


def fleet(capacity: CapacityModel, units, dispatched: int = 0) -> Fleet:
    f = Fleet(tuple(units), dispatched)
    f.check_integrity(capacity.allowed_degrees)
    return f


# ---- capacity model -------------------------------------------------------------------------


@pytest.mark.parametrize("spec, replicas, pool", [(DEFAULT, 8, 4096), (TINY_SPEC, 4, 2048),
                                                  (DEFAULT, 3, 65536)])
def test_capacity_model_matches_an_independent_count(spec, replicas, pool):
    m = spec
    h, inter, layers, dt = m.hidden_size, m.intermediate_size, m.num_layers, m.dtype_bytes
    q, kv = m.num_attention_heads * m.head_dim, m.num_kv_heads * m.head_dim
    embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    attention = layers * (2 * h * q + 2 * h * kv)
    ffn = layers * 3 * h * inter
    norms = layers * 2 * h + h
    tp1_weight_bytes = (embeddings + attention + ffn + norms) * dt + m.rotary_cache_bytes
    kv_bytes_per_token = layers * 2 * kv * dt
    cap = CapacityModel.from_kv_pool(spec, replicas, pool)
    assert cap.replica_budget_bytes == tp1_weight_bytes + pool * kv_bytes_per_token
    assert cap.owner_capacity_tokens(1) == pool
    for d in cap.allowed_degrees:
        freed = ffn * dt - ffn * dt // d
        assert cap.freed_bytes(d) == freed
        # A member's own pool gains exactly the tokens its freed FFN bytes are worth.
        assert cap.owner_capacity_tokens(d) == pool + freed // kv_bytes_per_token
        # ... and d pools of that many tokens, each of 1/d of a token's heads, fit its budget.
        held = cap.member_weight_bytes(d) + cap.owner_capacity_tokens(d) * kv_bytes_per_token
        assert held <= cap.replica_budget_bytes < held + kv_bytes_per_token


def test_default_model_numbers():
    cap = default_capacity()
    assert cap.allowed_degrees == (1, 3)
    # 2/3 of 30 x 3 x 576 x 1536 FFN parameters over 30 x 2 x 3 x 64 KV elements a token
    assert cap.owner_capacity_tokens(3) == 4096 + 2 * 30 * 3 * 576 * 1536 // 3 // (30 * 2 * 3 * 64)
    assert cap.owner_capacity_tokens(3) == 8704
    assert tiny_capacity().allowed_degrees == (1, 2, 4)
    assert tiny_capacity(replicas=2).allowed_degrees == (1, 2)
    assert (cap.is_long(4096), cap.is_long(4097)) == (False, True)
    assert (cap.degree_for(4097), cap.degree_for(8704), cap.degree_for(8705)) == (3, 3, None)


def test_pages_and_padding():
    paged = CapacityModel.from_kv_pool(DEFAULT, 3, 4096, page_size_tokens=100)
    assert (paged.owner_capacity_tokens(1), paged.owner_capacity_tokens(3)) == (4000, 8700)
    # Padding the intermediate size to 1539 at degree 3 keeps 513 columns per member.
    padded = CapacityModel.from_kv_pool(DEFAULT, 3, 4096, padded_intermediate_sizes=((3, 1539),))
    assert padded.ffn_bytes_per_layer(3) == 3 * 576 * 513 * 4
    assert padded.owner_capacity_tokens(3) < default_capacity(3).owner_capacity_tokens(3)
    with pytest.raises(ValueError, match="does not divide the intermediate size 1540"):
        CapacityModel.from_kv_pool(DEFAULT, 3, 4096, padded_intermediate_sizes=((3, 1540),))


def test_degree_refusal_names_the_heads_and_the_degree():
    assert degree_refusal(DEFAULT, 3) is None
    assert degree_refusal(DEFAULT, 2) == "degree 2 does not divide the model's 9 query / 3 KV heads"
    assert default_capacity().refusal(4) == (
        "degree 4 does not divide the model's 9 query / 3 KV heads")
    assert tiny_capacity(replicas=2).refusal(4) == "degree 4 needs more than the 2 replicas"
    assert "\n" not in degree_refusal(TINY_SPEC, 3)


# ---- dispatch -------------------------------------------------------------------------------


def test_dispatch_goes_to_the_least_loaded_member_with_room():
    cap = default_capacity(4)
    policy = AmoebasPolicy(cap)
    f = fleet(cap, singles(cap, {0: 3000, 1: 1000, 2: 1000, 3: 2000}))
    # 1 and 2 tie on load: the smaller replica id wins.
    assert policy.dispatch(Request("a", 1000, 100), f) == Dispatch((1,), 1)
    # Only the emptiest have room for 3000 tokens.
    assert policy.dispatch(Request("b", 2900, 100), f) == Dispatch((1,), 1)
    # Nothing has 3097 free tokens, but it fits a TP 1 pool: it waits for running work.
    assert isinstance(policy.dispatch(Request("c", 2997, 100), f), Queue)
    # A merged group's members count their load against their larger pools.
    group = unit(cap, (0, 1, 2), [(0, 6000, True, True), (1, 3000, False, True)])
    f = fleet(cap, [group, *singles(cap, {3: 2000})])
    assert policy.dispatch(Request("d", 900, 100), f) == Dispatch((0, 1, 2), 2)


def test_draining_group_takes_long_requests_only():
    cap = default_capacity(4)
    draining = unit(cap, (0, 1, 2), [(0, 3000, False, True)])
    assert draining.state is UnitState.DRAINING
    f = fleet(cap, [draining, *singles(cap, {3: 3300})])
    short, long = Request("s", 900, 100), Request("l", 6000, 200)
    assert isinstance(AmoebasPolicy(cap).dispatch(short, f), Queue)
    # Back-to-back long prompts: the draining group serves again, no transition.
    assert AmoebasPolicy(cap).dispatch(long, f) == Dispatch((0, 1, 2), 1)
    # Without prefer_merged a draining group is left to split.
    assert isinstance(AmoebasPolicy(cap, prefer_merged=False).dispatch(long, f), Queue)


# ---- merge ----------------------------------------------------------------------------------


def test_merge_takes_the_least_loaded_units_of_one_degree():
    cap = default_capacity(8)
    rng = random.Random(0)
    for _ in range(20):
        used = {m: rng.choice([0, 1100, 2200, 3300]) for m in range(8)}
        f = fleet(cap, singles(cap, used))
        decision = AmoebasPolicy(cap).dispatch(Request("l", 7000, 256), f)
        # Reference: the owner is the least-loaded replica (ties by id) if its TP 3 pool holds
        # the request now, the others the next two least-loaded.
        order = sorted(used, key=lambda m: (used[m], m))
        assert decision == Merge(tuple(sorted(order[:3])), 3, order[0],
                                 tuple((m,) for m in sorted(order[:3])))


def test_merge_waits_at_the_owner_when_no_pool_has_room_yet():
    cap = default_capacity(3)
    f = fleet(cap, singles(cap, {0: 3300, 1: 2200, 2: 3300}))
    decision = AmoebasPolicy(cap).dispatch(Request("l", 7000, 256), f)
    assert decision == Merge((0, 1, 2), 3, 1, ((0,), (1,), (2,)))


def test_merge_prefers_groups_already_merged():
    cap = tiny_capacity(8)
    owner = {d: cap.owner_capacity_tokens(d) for d in cap.allowed_degrees}
    assert owner == {1: 2048, 2: 2816, 4: 3200}
    pairs = [unit(cap, (0, 1), [(0, 2500, True, True)]), unit(cap, (2, 3),
                                                             [(3, 2500, True, True)])]
    f = fleet(cap, [*pairs, *singles(cap, {4: 0, 5: 0, 6: 0, 7: 0})])
    needs_tp4 = Request("l", 3000, 100)
    assert AmoebasPolicy(cap).dispatch(needs_tp4, f) == Merge((0, 1, 2, 3), 4, 1,
                                                              ((0, 1), (2, 3)))
    assert AmoebasPolicy(cap, prefer_merged=False).dispatch(needs_tp4, f) == Merge(
        (4, 5, 6, 7), 4, 4, ((4,), (5,), (6,), (7,)))
    # A long prompt a TP 2 group holds goes to the merged group with room: no transition.
    assert AmoebasPolicy(cap).dispatch(Request("m", 2000, 200), f) == Dispatch((0, 1), 1)


def test_units_of_different_degrees_do_not_merge():
    cap = tiny_capacity(4)
    f = fleet(cap, [unit(cap, (0, 1), [(0, 2500, True, True)]), *singles(cap, {2: 0, 3: 0})])
    decision = AmoebasPolicy(cap).dispatch(Request("l", 3000, 100), f)
    assert isinstance(decision, Queue) and "no units can merge" in decision.reason


def test_refuse_when_no_allowed_degree_holds_it():
    cap = default_capacity(8)
    f = fleet(cap, singles(cap, {m: 0 for m in range(8)}))
    for policy in (AmoebasPolicy(cap), MergeOnDemand(cap, "round_robin")):
        decision = policy.dispatch(Request("big", 8600, 105), f)
        assert isinstance(decision, Refuse)
        assert "8600 + max_new_tokens 105" in decision.reason and "8704" in decision.reason
    # The largest group exists only with enough replicas: on 2, a long prompt is refused.
    small = CapacityModel.from_kv_pool(DEFAULT, 2, 4096)
    assert isinstance(AmoebasPolicy(small).dispatch(Request("l", 5000, 100), fleet(
        small, singles(small, {0: 0, 1: 0}))), Refuse)


def test_transitioning_units_make_requests_wait():
    cap = default_capacity(3)
    merging = unit(cap, (0, 1, 2), [(1, 7256, True, False)], transitioning=True)
    f = fleet(cap, [merging])
    for request in (Request("s", 900, 100), Request("l", 5000, 100)):
        assert isinstance(AmoebasPolicy(cap).dispatch(request, f), Queue)


# ---- split ----------------------------------------------------------------------------------


def test_split_when_long_requests_are_done_and_half_is_free():
    cap = tiny_capacity(2)  # TP 2 pools of 2816 tokens (5632 in all), TP 1 pools of 2048
    policy = AmoebasPolicy(cap)

    def pair(*requests):
        return fleet(cap, [unit(cap, (0, 1), requests)])

    assert policy.maintenance(pair((0, 2500, True, True))) == []  # a long request runs
    # Every member's requests fit a TP 1 pool, but 3048 of 5632 tokens used: 46% free.
    assert policy.maintenance(pair((0, 2048, False, True), (1, 1000, False, True))) == []
    # 2816 used: exactly half free.
    (split,) = policy.maintenance(pair((0, 2048, False, True), (1, 768, False, True)))
    assert isinstance(split, Split) and split.members == (0, 1)
    # Half free, but member 0's own requests (admitted or queued) exceed a TP 1 pool.
    assert policy.maintenance(pair((0, 2100, False, True))) == []
    assert policy.maintenance(pair((0, 2000, False, True), (0, 100, False, False))) == []
    assert AmoebasPolicy(cap, split_free_fraction=0.6).maintenance(
        pair((0, 2048, False, True), (1, 768, False, True))) == []
    # The baselines split as soon as the long requests are done and the members fit.
    assert [s.members for s in MergeOnDemand(cap).maintenance(
        pair((0, 2048, False, True), (1, 1000, False, True)))] == [(0, 1)]


def test_a_group_of_four_splits_into_pairs_once_its_long_requests_fit_them():
    cap = tiny_capacity(4)  # owner pools: TP 1 2048, TP 2 2816, TP 4 3200 tokens
    tp1, tp2, tp4 = (cap.owner_capacity_tokens(d) for d in (1, 2, 4))
    assert tp1 < tp2 < tp4
    pairs = ((0, 1), (2, 3))
    policy = AmoebasPolicy(cap, groups=(*pairs, (0, 1, 2, 3)))

    def four(*requests):
        return fleet(cap, [unit(cap, (0, 1, 2, 3), requests)])

    # A request only the group of four holds: no split.
    assert policy.maintenance(four((0, tp2 + 1, True, True))) == []
    # Its long request fits a TP 2 pool: two TP 2 groups, the live server's aligned pairs.
    (split,) = policy.maintenance(four((2, tp2, True, True), (0, 100, False, True)))
    assert (split.members, split.degree, split.into) == ((0, 1, 2, 3), 2, pairs)
    # A queued request counts: member 2's own requests exceed a TP 2 pool.
    assert policy.maintenance(four((2, tp2 - 100, True, True), (2, 200, False, False))) == []
    # No long request left and every member fits a TP 1 pool: straight to replicas alone.
    (alone,) = policy.maintenance(four((2, tp1, False, True)))
    assert (alone.degree, alone.into) == (1, ((0,), (1,), (2,), (3,)))
    # Less than half free: no split of either kind.
    assert policy.maintenance(four(*((m, tp4 // 2 + 50, m == 0, True) for m in range(4)))) == []
    # Without split_to_groups the group waits for its long requests to end.
    assert AmoebasPolicy(cap, split_to_groups=False).maintenance(
        four((2, tp2, True, True))) == []
    # Without the live server's groups (the simulator), the members in order.
    (sim_split,) = AmoebasPolicy(cap).maintenance(four((3, tp2, True, True)))
    assert sim_split.into == pairs
    # The baselines split only into replicas alone.
    assert MergeOnDemand(cap).maintenance(four((2, tp2, True, True))) == []


def test_a_split_names_groups_that_tile_it():
    with pytest.raises(ValueError, match="tile"):
        Split((0, 1, 2, 3), "r", 2, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="tile"):
        Split((0, 1, 2, 3), "r", 2, ((0, 1, 2), (3,)))
    assert Split((0, 1), "r").into == ((0,), (1,))


# ---- baselines, determinism, integrity ------------------------------------------------------


def test_baselines_place_blind_to_free_tokens_and_merge_only_when_nothing_holds():
    cap = default_capacity(4)
    f = fleet(cap, singles(cap, {0: 3300, 1: 3300, 2: 1100, 3: 3300}), dispatched=5)
    short = Request("s", 1000, 100)
    assert MergeOnDemand(cap, "round_robin").dispatch(short, f) == Dispatch((1,), 1)
    assert MergeOnDemand(cap, "least_loaded").dispatch(short, f) == Dispatch((2,), 2)
    long = Request("l", 6000, 200)
    assert MergeOnDemand(cap, "round_robin").dispatch(long, f) == Merge(
        (1, 2, 3), 3, 1, ((1,), (2,), (3,)))
    assert MergeOnDemand(cap, "least_loaded").dispatch(long, f) == Merge(
        (0, 1, 2), 3, 2, ((0,), (1,), (2,)))
    # A serving group's pool holds it: it queues there, no merge.
    group = unit(cap, (0, 1, 2), [(0, 7000, True, True)])
    f = fleet(cap, [group, *singles(cap, {3: 0})])
    assert MergeOnDemand(cap, "least_loaded").dispatch(long, f) == Dispatch((0, 1, 2), 1)
    # Read as "fits no TP 1 replica", every long prompt merges a group of its own.
    per_long = MergeOnDemand(cap, "least_loaded", reuse_groups=False)
    assert per_long.name == "least_loaded_merge_on_demand_per_long"
    assert isinstance(per_long.dispatch(long, f), Queue)  # one TP 1 replica left
    assert per_long.dispatch(short, f) == Dispatch((0, 1, 2), 1)
    wide = default_capacity(6)
    f = fleet(wide, [unit(wide, (0, 1, 2), [(0, 7000, True, True)]),
                     *singles(wide, {3: 1100, 4: 0, 5: 2200})])
    assert per_long.dispatch(long, f) == Merge((3, 4, 5), 3, 4, ((3,), (4,), (5,)))


def test_decisions_are_deterministic_and_ignore_unit_order():
    cap = tiny_capacity(8)
    rng = random.Random(1)
    policies = (AmoebasPolicy(cap), MergeOnDemand(cap, "round_robin"),
                MergeOnDemand(cap, "least_loaded"))
    for _ in range(30):
        used = {m: rng.choice([0, 500, 1000, 1500]) for m in range(4, 8)}
        units = [unit(cap, (0, 1), [(0, 2500, True, True)] if rng.random() < 0.5 else []),
                 unit(cap, (2, 3)), *singles(cap, used)]
        request = Request("r", rng.choice([400, 1900, 2700, 3000]), 100)
        for policy in policies:
            decisions = {policy.dispatch(request, fleet(cap, order, 3))
                         for order in itertools.permutations(units, len(units))
                         if rng.random() < 0.05} | {policy.dispatch(request,
                                                                    fleet(cap, units, 3))}
            assert len(decisions) == 1


def test_check_integrity_finds_broken_fleets():
    cap = default_capacity(4)
    good = singles(cap, {0: 100, 1: 0, 2: 0, 3: 0})
    fleet(cap, good)
    bad = {
        "another unit": [*good, unit(cap, (0,))],
        "not allowed": [unit(cap, (0, 1)), *good[2:]],
        "its requests": [Unit((0,), 1, (4096,), (50,), (0,)), *good[1:]],
        "tokens used": [unit(cap, (0,), [(0, 5000, False, True)]), *good[1:]],
    }
    for message, units in bad.items():
        with pytest.raises(ValueError, match=message):
            Fleet(tuple(units)).check_integrity(cap.allowed_degrees)
