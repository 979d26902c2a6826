"""Control plane on synthetic signal sequences: monitor, modes, controller (no SGLang needed)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sglang_morph.morph.control import (
    MODES,
    ModePolicy,
    LayerCosts,
    MorphController,
    PressureMonitor,
    PressureSignals,
    PressureSnapshot,
    SwapLayers,
    get_mode,
)

# 16 -> 4 frees exactly 1200 tokens (75 pages of 16), 16 -> 8 frees 800.
COSTS = LayerCosts({16: 160_000, 8: 80_000, 4: 40_000}, kv_bytes_per_token=100, page_size_tokens=16)
ALL_BITS = (16, 8, 4)
# The rule tests drive this fixed policy, not the live mode table (which is tuned from the
# replay benchmark): KV high 0.85 (quiet below 0.75), a KV-short head acts at 0.5 s, 3 high
# steps, 2 layers per action (up to 16 for a queue), W8 then W4, restores 4 layers after 5 s
# of quiet while the KV stays under half full, hold at most 30 s, 0.5 s cooldown.
RULES = ModePolicy(
    name="rules", kv_usage_high=0.85, queue_delay_high_s=0.5, persist_steps=3,
    layers_per_step=2, max_layers_per_step=16, bits_sequence=(8, 4), kv_usage_quiet_margin=0.1,
    kv_usage_low=0.5, restore_quiet_s=5.0, restore_hold_max_s=30.0, restore_layers_per_step=4,
    cooldown_s=0.5)


def sig(t, usage=0.0, waiting=0, head_wait_s=0.0, retractions=0, cap=10_000, used=None,
        reserved=0, head_need=None, waiting_need=0, gap=0.0, step_s=0.0, release=(),
        running=None):
    """Synthetic signals; a waiting head needs the whole pool unless ``head_need`` says
    otherwise, i.e. it waits for KV, and no running request's finish makes room for it unless
    ``release`` ((steps to finish, KV tokens released), ...) says otherwise. Requests run
    while KV is held, unless ``running`` says otherwise."""
    used = round(usage * cap) if used is None else used
    running = int(used > 0) if running is None else running
    return PressureSignals(
        time_s=t, kv_usage=used / cap if cap else 0.0, kv_usage_ewma=used / cap if cap else 0.0,
        num_waiting_reqs=waiting, head_wait_s=head_wait_s, queue_delay_ewma_s=head_wait_s,
        retractions_delta=retractions, num_running_reqs=running, kv_capacity_tokens=cap,
        kv_used_tokens=used, ttft_ewma_s=None, tpot_ewma_s=None, kv_reserved_tokens=reserved,
        head_need_tokens=(cap if waiting else 0) if head_need is None else head_need,
        waiting_need_tokens=waiting_need, sample_gap_s=gap, step_s=step_s,
        running_kv_release=tuple(sorted(release)),
    )


def policy(base=RULES, **kw):
    return dataclasses.replace(base, **kw)


def ctl(pol=RULES, order=(0, 1, 2, 3, 4, 5, 6, 7), bits=ALL_BITS, cap=None):
    return MorphController(pol, order, bits, COSTS, max_quantized_layers=cap)


def apply(bits, action):
    bits = list(bits)
    for i in action.layers:
        bits[i] = action.bits
    return tuple(bits)


def drive(c, layer_bits, signals):
    """Feed signals, applying every action; returns (actions with their time, final bits)."""
    actions = []
    for s in signals:
        a = c.decide(s, layer_bits)
        if a is not None:
            actions.append((s.time_s, a))
            layer_bits = apply(layer_bits, a)
    return actions, layer_bits


FULL8 = (16,) * 8

# --------------------------------------------------------------------------- swap triggers


def test_kv_high_acts_only_after_persist_steps_consecutive():
    c = ctl()
    usages = [0.9, 0.9, 0.7, 0.9, 0.9]  # the 0.7 step breaks the streak
    assert all(c.decide(sig(0.1 * i, u), FULL8) is None for i, u in enumerate(usages))
    a = c.decide(sig(0.5, 0.9), FULL8)  # third consecutive high step
    assert a == SwapLayers((0, 1), 8, a.reason) and not a.restore  # default: W8 first
    assert "kv_usage 0.90 >= 0.85" in a.reason and "frees 1600 KV tokens" in a.reason


def test_isolated_spikes_never_act():
    c = ctl()
    seq = [sig(0.1 * i, 0.97 if i % 3 == 0 else 0.5) for i in range(300)]
    assert drive(c, FULL8, seq)[0] == []


def test_queue_delay_trigger_is_the_wait_for_kv_the_head_faces():
    # Default: a head short of KV triggers once it will have waited 0.5 s before the running
    # requests' finishes free enough KV (waited so far + steps to that finish x step length).
    def blocked(t, waited, steps_to_room, step_s=0.1, **kw):
        # 8000 held in a 10000 pool (usage 0.8, below the trigger); the head needs 2500, so 500
        # must come back: the request that finishes in ``steps_to_room`` steps releases 600,
        # another one 10 steps later.
        return sig(t, used=8000, waiting=2, head_wait_s=waited, head_need=2500, step_s=step_s,
                   release=((steps_to_room, 600), (steps_to_room + 10, 3000)), **kw)

    assert blocked(0.0, 0.0, 3).head_kv_wait_s() == pytest.approx(0.3)
    # Room comes in 3 steps (0.3 s): the head is admitted before 0.5 s, nothing moves, also
    # while it waits and the finishing request counts down.
    soon = [blocked(0.1 * i, 0.1 * i, 3 - i) for i in range(3)]
    assert drive(ctl(), FULL8, soon)[0] == []
    # Room comes only in 6 steps: the head would wait 0.6 s, so the first look acts.
    late = drive(ctl(), FULL8, [blocked(0.0, 0.0, 6)])[0]
    assert [(t, a.layers) for t, a in late] == [(0.0, (0, 1))]
    assert "head short of KV would wait 0.60 s (waited 0.00 s) >= 0.5 s with 2 waiting" \
        in late[0][1].reason
    # Waited 0.45 s already, one step to go: 0.55 s.
    assert len(drive(ctl(), FULL8, [blocked(0.0, 0.45, 1)])[0]) == 1
    # Nothing running frees enough (the head needs more than the pool): act at once.
    assert sig(0.0, used=8000, waiting=1, head_need=2500).head_kv_wait_s() == math.inf
    assert len(drive(ctl(), FULL8, [sig(0.0, used=8000, waiting=1, head_need=2500)])[0]) == 1
    # No step length known yet (first busy sample): only the wait so far counts.
    unknown = [blocked(0.1 * i, 0.1 * i, 50, step_s=0.0) for i in range(6)]
    assert [t for t, _ in drive(ctl(), FULL8, unknown)[0]] == [pytest.approx(0.5)]
    # A waiting request that fits is not short of KV, however long it waited.
    assert sig(0.0, used=100, waiting=1, head_need=100, head_wait_s=9.0).head_kv_wait_s() == 0.0
    nobody_waits = [sig(0.1 * i, 0.3, waiting=0, head_wait_s=0.5) for i in range(10)]
    assert drive(ctl(), FULL8, nobody_waits)[0] == []


def test_queue_delay_threshold_is_per_mode():
    # The same head (would wait 0.3 s for KV) triggers performance (0.1 s) only.
    s = [sig(0.1 * i, used=7000, waiting=1, head_need=3500, step_s=0.1, release=((3, 600),))
         for i in range(6)]
    assert drive(ctl(get_mode("performance")), FULL8, s[:1])[0]
    assert drive(ctl(get_mode("default")), FULL8, s)[0] == []
    assert drive(ctl(get_mode("accuracy")), FULL8, s)[0] == []


def test_queue_that_waits_for_compute_does_not_quantize():
    # 3000 held + 2000 reserved for running outputs + 400 for the head < 10000: the head fits,
    # it waits for the GPU/CPU, not for KV; one token more than the pool and it is blocked.
    computing = [sig(0.1 * i, 0.3, waiting=4, head_wait_s=1.0, reserved=2000, head_need=400)
                 for i in range(20)]
    assert drive(ctl(), FULL8, computing)[0] == []
    assert not computing[0].head_blocked_by_kv
    blocked = [sig(0.1 * i, 0.3, waiting=4, head_wait_s=1.0, reserved=6601, head_need=400)
               for i in range(3)]
    assert blocked[0].head_blocked_by_kv
    assert len(drive(ctl(), FULL8, blocked)[0]) == 1


def test_retraction_acts_at_once_but_respects_cooldown():
    c = ctl(policy(cooldown_s=1.0))
    a = c.decide(sig(0.0, 0.3, retractions=2), FULL8)
    assert a is not None and a.layers == (0, 1) and "2 retraction(s)" in a.reason
    bits = apply(FULL8, a)
    assert c.decide(sig(0.5, 0.3, retractions=1), bits) is None  # inside the cooldown
    assert c.decide(sig(0.6, 0.3), bits) is None  # the retraction streak did not survive calm
    assert c.decide(sig(1.1, 0.3, retractions=1), bits).layers == (2, 3)


# --------------------------------------------------------------------------- layer choice


def test_layers_follow_swap_order_and_never_leave_it():
    order = (5, 2, 7, 0)
    c = ctl(policy(cooldown_s=0.0), order=order)
    actions, bits = drive(c, FULL8, [sig(0.1 * i, 0.95) for i in range(40)])
    # W8 on every layer of the order before any goes on to W4.
    assert [(a.layers, a.bits) for _, a in actions] == [
        ((5, 2), 8), ((7, 0), 8), ((5, 2), 4), ((7, 0), 4)]
    assert bits == (4, 16, 4, 16, 16, 4, 16, 4)  # layers 1, 3, 4, 6 are not in the order


@pytest.mark.parametrize("mode,per_step", [("accuracy", 1), ("default", 3), ("performance", 4)])
def test_layers_per_step_per_mode(mode, per_step):
    actions, _ = drive(ctl(get_mode(mode)), FULL8, [sig(0.1 * i, 0.99) for i in range(6)])
    assert actions and actions[0][1].layers == tuple(range(per_step))


@pytest.mark.parametrize("waiting_need,layers", [
    (0, 2),         # nothing waits: layers_per_step
    (1000, 3),      # room for 10300 at usage 0.85: 12118 - 10000 = 2118 -> 3 W8 layers (2400)
    (4000, 8),      # 13300 / 0.85 = 15647 -> 5647 missing -> 8 W8 layers (6400)
    (100_000, 16),  # more than any action may free: max_layers_per_step
])
def test_swap_size_covers_the_waiting_deficit(waiting_need, layers):
    order = tuple(range(20))
    # 9000 held + 300 reserved in a 10000 pool (usage 0.9: high without any queue).
    seq = [sig(0.1 * i, used=9000, reserved=300, waiting=3 if waiting_need else 0,
               head_wait_s=0.5, waiting_need=waiting_need) for i in range(3)]
    assert seq[0].kv_deficit_tokens() == (max(0, waiting_need - 700) if waiting_need else 0)
    actions, _ = drive(ctl(order=order), (16,) * 20, seq)
    assert actions[0][1].layers == order[:layers] and actions[0][1].bits == 8


def test_accuracy_goes_to_8_everywhere_before_4():
    c = ctl(policy(MODES["accuracy"], cooldown_s=0.0), order=(2, 0, 1))
    actions, bits = drive(c, (16,) * 4, [sig(0.1 * i, 0.99) for i in range(100)])
    assert [(a.layers, a.bits) for _, a in actions] == [
        ((2,), 8), ((0,), 8), ((1,), 8), ((2,), 4), ((0,), 4), ((1,), 4)]
    assert bits == (4, 4, 4, 16)


def test_accuracy_skips_bit_widths_the_engines_lack():
    c = ctl(policy(MODES["accuracy"], cooldown_s=0.0), order=(0,), bits=(16, 4))
    assert [(a.layers, a.bits) for _, a in drive(c, (16,), [sig(i, 0.99) for i in range(20)])[0]] \
        == [((0,), 4)]


def test_max_quantized_layers_caps_new_quantization():
    c = ctl(policy(cooldown_s=0.0, bits_sequence=(4,)), cap=3)
    actions, bits = drive(c, FULL8, [sig(0.1 * i, 0.99) for i in range(50)])
    assert [a.layers for _, a in actions] == [(0, 1), (2,)]
    assert sum(b < 16 for b in bits) == 3
    # With accuracy's 8-then-4 the cap bounds the 8-bit stage and 4 bits reuse the same layers.
    c = ctl(policy(MODES["accuracy"], cooldown_s=0.0), cap=2)
    actions, bits = drive(c, FULL8, [sig(0.1 * i, 0.99) for i in range(100)])
    assert [(a.layers, a.bits) for _, a in actions] == [((0,), 8), ((1,), 8), ((0,), 4), ((1,), 4)]
    # Statically quantized layers outside the order count towards the cap.
    c = ctl(cap=1, order=(0, 1))
    assert drive(c, (16, 16, 4), [sig(0.1 * i, 0.99) for i in range(10)])[0] == []


def test_nothing_left_to_swap_returns_none():
    c = ctl(policy(cooldown_s=0.0), order=(0, 1))
    bits = (4, 4, 16)
    assert all(c.decide(sig(0.1 * i, 0.99), bits) is None for i in range(20))


# --------------------------------------------------------------------------- restore


def swapped_controller(pol, order=(0, 1, 2, 3)):
    """A controller that has just quantized every layer of ``order`` (at t < 0)."""
    c = ctl(pol, order=order)
    actions, bits = drive(c, (16,) * 4, [sig(-10 + 0.1 * i, 1.0) for i in range(40)])
    assert all(b == 4 for b in bits)
    return c, bits


def test_restore_waits_for_quiet_wall_time_whatever_the_sampling():
    pol = policy(restore_quiet_s=5.0, cooldown_s=0.0)
    # A head short of KV that the running requests' finishes admit within 0.2 s: not pressure,
    # not calm either.
    def kv_short(t):
        return sig(t, 0.1, waiting=1, head_need=9500, step_s=0.1, release=((2, 1000),))

    busy = kv_short(0.0)

    def first_restore(seq):
        c, bits = swapped_controller(pol)  # pressure ended at t = -6.1
        actions, _ = drive(c, bits, [busy] + seq)
        return actions[0][0] if actions else None

    # The window starts at the last step that was not calm (t = 0), dense or sparse samples:
    assert first_restore([sig(0.1 * i, 0.1) for i in range(1, 60)]) == pytest.approx(5.0)
    # an idle scheduler under --sleep-on-idle steps once a second: still 5 s, not 10 samples.
    assert first_restore([sig(1.0 * i, 0.1) for i in range(1, 12)]) == pytest.approx(5.0)
    # A request short of KV restarts the window ...
    seq = [kv_short(0.1 * i) if i == 30 else sig(0.1 * i, 0.1) for i in range(1, 90)]
    assert first_restore(seq) == pytest.approx(8.0)
    # ... one that waits a step for compute (it fits) does not, but no restore happens while
    # it waits.
    def arrival(t):
        return sig(t, 0.1, waiting=1, head_need=10)

    seq = [arrival(0.1 * i) if i in (30, 50) else sig(0.1 * i, 0.1) for i in range(1, 90)]
    assert first_restore(seq) == pytest.approx(5.1)
    # Usage between the quiet threshold (0.75) and the trigger (0.85) never counts as quiet.
    assert first_restore([sig(0.1 * i, 0.8) for i in range(1, 200)]) is None
    # The window also starts at the last transition: right after the swap at t = -8.3 the
    # pressure (t = -6.1) is the later of the two; with no step after the swap, the swap is.
    c, bits = swapped_controller(pol)
    c.note_transition(-1.0)
    assert drive(c, bits, [sig(0.5 * i, 0.1) for i in range(20)])[0][0][0] == pytest.approx(4.0)


@pytest.mark.parametrize("used,reserved,restored", [
    (3500, 0, (3, 2)), (4000, 0, (3,)), (4500, 0, ()),
    # What the running requests still claim counts like what they hold.
    (2000, 1500, (3, 2)), (2000, 2500, ()),
])
def test_restore_limited_by_predicted_usage(used, reserved, restored):
    # Each restore takes 1200 tokens back from a 10000-token pool; kv_usage_low is 0.5:
    # 3500/7600 = 0.46 fits two, 4000/8800 = 0.45 fits one (4000/7600 = 0.53 does not),
    # 4500/8800 = 0.51 fits none.
    c, bits = swapped_controller(policy(restore_quiet_s=1.0))
    actions, _ = drive(c, bits, [sig(0.5 * i, used=used, reserved=reserved) for i in range(2)])
    assert tuple(a.layers for _, a in actions) == ((restored,) if restored else ())
    if restored:
        assert actions[0][1].restore and actions[0][1].bits == 16


def test_restore_order_is_reverse_swap_order_and_goes_straight_to_16():
    pol = policy(MODES["accuracy"], cooldown_s=0.0, restore_layers_per_step=2)
    c, bits = swapped_controller(pol, order=(2, 0, 3, 1))
    actions, bits = drive(c, bits, [sig(0.5 * i, 0.0) for i in range(100)])
    assert [(a.layers, a.bits) for _, a in actions] == [((1, 3), 16), ((0, 2), 16)]
    assert bits == (16,) * 4


def test_cooldown_spaces_actions():
    c = ctl(policy(cooldown_s=1.0))
    actions, _ = drive(c, FULL8, [sig(0.1 * i, 0.99) for i in range(40)])
    times = [t for t, _ in actions]
    assert times == pytest.approx([0.2, 1.2, 2.2, 3.2])  # high steps counted during cooldown


# --------------------------------------------------------------------------- stability


def test_alternating_high_low_every_step_never_acts():
    seq = [sig(0.1 * i, 0.95 if i % 2 else 0.1) for i in range(200)]
    assert drive(ctl(policy(persist_steps=2)), FULL8, seq)[0] == []


class Server:
    """Toy server: KV capacity grows/shrinks with the actions, demand beyond it queues."""

    def __init__(self, c, capacity_tokens=10_000):
        self.c, self.cap, self.bits = c, capacity_tokens, FULL8
        self.actions, self.caps = [], []  # caps[i]: capacity right after actions[i]

    def step(self, t, demand_tokens):
        used = min(demand_tokens, self.cap)
        waiting = int(demand_tokens > used)
        a = self.c.decide(sig(t, used=used, cap=self.cap, waiting=waiting,
                              head_wait_s=0.5 * waiting), self.bits)
        if a is not None:
            self.cap += sum(COSTS.freed_tokens(self.bits[i], a.bits) for i in a.layers)
            self.bits = apply(self.bits, a)
            self.actions.append((t, a))
            self.caps.append(self.cap)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_bursty_load_gives_bounded_actions_and_no_flapping(mode):
    # 200 steps of 0.1 s alternating 2 s bursts (demand above capacity) and 2 s lulls. Lulls are
    # shorter than every quiet window, so a restore needs a burst that the grown pool absorbs
    # without pressure; every restore comes a full quiet window after the previous action.
    pol = get_mode(mode)
    srv = Server(ctl(pol))
    for i in range(200):
        srv.step(0.1 * i, 12_000 if (i // 20) % 2 == 0 else 1_000)
    assert 1 <= len(srv.actions) <= 16  # 8 layers; 16 -> 8 -> 4 at most one layer per action
    restores = [i for i, (_, a) in enumerate(srv.actions) if a.restore]
    assert len(restores) <= 20.0 / pol.restore_quiet_s
    for i in restores:
        assert srv.actions[i][0] - srv.actions[i - 1][0] >= pol.restore_quiet_s
    # Swapping stops as soon as the pool absorbs a burst below the trigger, in every mode.
    enough = [i for i, cap in enumerate(srv.caps) if 12_000 / cap < pol.kv_usage_high]
    assert enough and not any(not a.restore for _, a in srv.actions[enough[0] + 1:])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_steady_load_converges(mode):
    # Burst, then a long steady moderate load: after adapting, the controller must go still
    # (no restore that the next step would undo, no swap that the quiet window would undo).
    srv = Server(ctl(get_mode(mode)))
    for i in range(2000):
        srv.step(0.1 * i, 13_000 if i < 100 else 5_000)
    assert srv.actions and all(t < 100.0 for t, _ in srv.actions)
    swaps_then_restores = [a.restore for _, a in srv.actions]
    assert swaps_then_restores == sorted(swaps_then_restores)  # never swap after a restore
    assert 5_000 / srv.cap < get_mode(mode).kv_usage_high


def test_slow_square_wave_learns_the_lull_and_keeps_the_capacity():
    # 4 cycles of 10 s burst / 10 s lull at 0.2 s per step. The first lull restores after the
    # 5 s quiet window; the next burst needs that capacity again, so the lull (10.2 s from the
    # last busy step to the next) is learned and later lulls hold the capacity for 1.5 x that:
    # the later bursts find the grown pool and nothing moves any more.
    c = ctl(policy(cooldown_s=0.0, restore_layers_per_step=8))
    srv = Server(c)
    for i in range(400):
        srv.step(0.2 * i, 12_000 if i % 100 < 50 else 0)
    assert [(round(t, 1), a.restore) for t, a in srv.actions] == [
        (0.0, False), (0.6, False), (1.2, False), (14.8, True),
        (20.0, False), (20.6, False), (21.2, False)]
    assert c.restore_hold_s == pytest.approx(1.5 * 10.2)
    # Capped by the mode: with restore_hold_max_s 8 s every lull restores again (at 8 s).
    c = ctl(policy(cooldown_s=0.0, restore_layers_per_step=8, restore_hold_max_s=8.0))
    srv = Server(c)
    for i in range(400):
        srv.step(0.2 * i, 12_000 if i % 100 < 50 else 0)
    assert [round(t, 1) for t, a in srv.actions if a.restore] == [14.8, 37.8, 57.8, 77.8]


def test_a_lull_with_light_traffic_is_learned_and_holds_the_next_restore():
    # Bursts 30 s apart with light traffic between them (never idle): the gap (from the last
    # step that needed the grown pool to the next) is the lull. The first gap restores after
    # the 5 s quiet window, light arrivals (a request waiting a step for compute) and all; the
    # next burst needs the capacity again, so the lull is learned and the following gap keeps
    # the grown pool.
    c = ctl(policy(cooldown_s=0.0, restore_layers_per_step=8, restore_hold_max_s=60.0))
    srv = Server(c)
    for i in range(450):
        t = 0.2 * i
        burst = t % 30.0 < 5.0
        srv.step(t, 12_000 if burst else 2_000)
        if not burst and i % 10 == 0:  # an arrival waits one step for compute
            a = c.decide(sig(t + 0.1, used=2_000, cap=srv.cap, waiting=1, head_need=50),
                         srv.bits)
            assert a is None or not a.restore
    restores = [round(t, 1) for t, a in srv.actions if a.restore]
    assert restores == [pytest.approx(9.8)]
    assert c.restore_hold_s == pytest.approx(1.5 * 25.2)


def test_a_lull_counts_only_if_the_burst_after_it_needs_the_capacity():
    # Long lulls ended by small loads that the full-precision pool would absorb are not bursts:
    # the hold stays the quiet window.
    c = ctl(policy(cooldown_s=0.0, restore_layers_per_step=8))
    srv = Server(c)
    for i in range(400):
        srv.step(0.2 * i, 12_000 if i < 50 else (3_000 if i % 100 < 50 else 0))
    assert c.restore_hold_s == RULES.restore_quiet_s
    assert [a.restore for _, a in srv.actions] == [False, False, False, True]


class Decoding:
    """Toy server with running requests that decode one token per step: each holds KV and
    still claims KV for its remaining output; held KV beyond the pool retracts the request
    with the most output left (its KV is freed and it waits)."""

    def __init__(self, c, requests, capacity_tokens=10_000, blind=False):
        self.c, self.cap, self.bits = c, capacity_tokens, (4, 4, 4, 4)
        self.reqs = [list(r) for r in requests]  # [held, left]
        self.blind = blind  # controller sees no reservations: held-only prediction
        self.actions, self.retractions = [], 0

    def step(self, t):
        for r in self.reqs:
            if r[1] > 0:
                r[0], r[1] = r[0] + 1, r[1] - 1
        self.reqs = [r for r in self.reqs if r[1] > 0]
        retracted = 0
        while sum(r[0] for r in self.reqs) > self.cap:
            self.reqs.remove(max(self.reqs, key=lambda r: r[1]))
            retracted += 1
        self.retractions += retracted
        held = sum(r[0] for r in self.reqs)
        reserved = 0 if self.blind else sum(r[1] for r in self.reqs)
        a = self.c.decide(sig(t, used=held, cap=self.cap, reserved=reserved,
                              retractions=retracted), self.bits)
        if a is not None:
            self.cap += sum(COSTS.freed_tokens(self.bits[i], a.bits) for i in a.layers)
            self.bits = apply(self.bits, a)
            self.actions.append((t, a))


def test_restore_counts_what_running_requests_still_claim_so_it_does_not_thrash():
    # Four W4 layers grant 4 x 1200 tokens: the pool is 10000. Six running requests hold 400
    # tokens each and will write 800 more each (7200 at the end), 0.1 s per token.
    requests = [(400, 800)] * 6

    def run(blind):
        # A pool allowed to fill up before it counts as high, so the only alarm left is the
        # retraction that a too-small pool causes.
        pol = policy(kv_usage_high=1.0, kv_usage_quiet_margin=0.3)
        c, _ = swapped_controller(pol)  # pressure ended at t = -6.1
        srv = Decoding(c, requests, blind=blind)
        for i in range(1000):
            srv.step(0.1 * i)
        return srv

    # Held-only prediction (2400 held: 2400 / 5200 < 0.5) restores all four layers at once,
    # the requests outgrow the 5200-token pool, one is retracted and the controller swaps
    # again: thrash, and a request thrown back to the queue.
    blind = run(blind=True)
    assert [(a.restore, a.layers) for _, a in blind.actions][:2] == [
        (True, (3, 2, 1, 0)), (False, (0, 1))]
    assert "retraction" in blind.actions[1][1].reason and blind.retractions == 1
    # Held + reserved (7200 of 10000 after any restore is >= 0.5 of the smaller pool): nothing
    # moves until the requests finish at t = 80 s, then one restore brings every layer back.
    aware = run(blind=False)
    assert aware.retractions == 0
    assert [(a.restore, a.layers) for _, a in aware.actions] == [(True, (3, 2, 1, 0))]
    assert aware.actions[0][0] > 80.0


# --------------------------------------------------------------------------- modes


def test_set_policy_switches_mode_and_resets_streaks():
    c = ctl()
    assert c.decide(sig(0.0, 0.95), FULL8) is None
    assert c.decide(sig(0.1, 0.95), FULL8) is None  # default would act on the next high step
    c.set_policy(get_mode("performance"))
    assert c.policy is MODES["performance"]
    assert c.decide(sig(0.2, 0.95), FULL8) is None  # streak restarted: 1 of 2
    assert c.decide(sig(0.3, 0.95), FULL8).layers == (0, 1, 2, 3)
    # Layer state belongs to the caller: 8-bit layers left by accuracy go on to 4 bits.
    c = ctl(get_mode("performance"))
    bits = (8, 8, 16, 16, 16, 16, 16, 16)
    actions, _ = drive(c, bits, [sig(0.1 * i, 0.95) for i in range(2)])
    assert [(a.layers, a.bits) for _, a in actions] == [((0, 1, 2, 3), 4)]


def test_modes_are_ordered_from_cautious_to_eager():
    acc, dft, perf = MODES["accuracy"], MODES["default"], MODES["performance"]
    assert acc.kv_usage_high > dft.kv_usage_high > perf.kv_usage_high
    assert acc.queue_delay_high_s > dft.queue_delay_high_s > perf.queue_delay_high_s
    assert acc.layers_per_step < dft.layers_per_step < perf.layers_per_step
    assert acc.bits_sequence == dft.bits_sequence == (8, 4) and perf.bits_sequence == (4,)
    assert acc.restore_hold_max_s < dft.restore_hold_max_s < perf.restore_hold_max_s
    assert get_mode("default") is MODES["default"]


def test_get_mode_names_the_valid_modes():
    with pytest.raises(ValueError, match="accuracy, default, performance"):
        get_mode("fast")


@pytest.mark.parametrize("bad", [
    {"kv_usage_low": 0.8},  # above the quiet threshold 0.75: no hysteresis gap
    {"kv_usage_high": 1.2},
    {"persist_steps": 0},
    {"cooldown_s": -1.0},
    {"bits_sequence": (4, 8)},
    {"bits_sequence": (16,)},
    {"bits_sequence": ()},
    {"max_layers_per_step": 1},  # below layers_per_step (2)
])
def test_policy_validation(bad):
    with pytest.raises(ValueError, match="ModePolicy 'rules'"):
        policy(**bad)


# --------------------------------------------------------------------------- costs


def test_layer_costs_round_to_pages_in_the_safe_direction():
    costs = LayerCosts({16: 10_000, 4: 2_999}, kv_bytes_per_token=7, page_size_tokens=16)
    # 7001 bytes = 1000.14 tokens: gaining rounds down to 62 pages, giving back rounds up to 63.
    assert costs.freed_tokens(16, 4) == 992
    assert costs.freed_tokens(4, 16) == -1008
    assert costs.freed_tokens(4, 4) == 0
    assert COSTS.freed_tokens(16, 4) == 1200 and COSTS.freed_tokens(4, 16) == -1200
    assert COSTS.freed_tokens(8, 4) == 400 and COSTS.freed_tokens(16, 8) == 800


@pytest.mark.parametrize("kw", [
    {"layer_bytes_by_bits": {8: 1, 4: 1}},  # no 16
    {"layer_bytes_by_bits": {16: 10, 4: 20}},  # 4 bits bigger than 16
    {"layer_bytes_by_bits": {16: 10, 4: 0}},
    {"kv_bytes_per_token": 0},
    {"page_size_tokens": 0},
])
def test_layer_costs_validation(kw):
    with pytest.raises(ValueError, match="LayerCosts"):
        dataclasses.replace(COSTS, **kw)
    with pytest.raises(ValueError, match="no size for 3-bit"):
        COSTS.freed_tokens(16, 3)


# --------------------------------------------------------------------------- validation


def test_controller_and_action_validation():
    with pytest.raises(ValueError, match="distinct"):
        ctl(order=(0, 1, 1))
    with pytest.raises(ValueError, match="distinct"):
        ctl(order=(-1, 0))
    with pytest.raises(ValueError, match="no size for 3-bit"):
        ctl(bits=(16, 3))
    with pytest.raises(ValueError, match="max_quantized_layers"):
        ctl(cap=-1)
    with pytest.raises(ValueError, match="names layer 7 but the model has 4 layers"):
        ctl().decide(sig(0.0), (16,) * 4)
    c = ctl()
    c.decide(sig(0.0), FULL8)
    with pytest.raises(ValueError, match="expected 8"):
        c.decide(sig(0.1), (16,) * 9)
    with pytest.raises(ValueError, match="no size for 3-bit"):
        c.decide(sig(0.2), (3,) + (16,) * 7)
    with pytest.raises(ValueError):
        SwapLayers((), 4, "x")
    with pytest.raises(ValueError):
        SwapLayers((1, 1), 4, "x")
    with pytest.raises(ValueError):
        SwapLayers((1,), 32, "x")
    assert SwapLayers((1,), 16, "x").restore


# --------------------------------------------------------------------------- monitor


def snap(t, used=0, cap=100, waiting=0, running=1, head_wait_s=0.0, retractions=0):
    return PressureSnapshot(t, cap, used, waiting, running, head_wait_s, retractions)


def test_monitor_ewma_ratio_and_retraction_delta():
    m = PressureMonitor(ewma_alpha=0.5)
    s0 = m.observe(snap(0.0, used=0, retractions=5, head_wait_s=0.4, waiting=2))
    assert (s0.kv_usage, s0.kv_usage_ewma, s0.retractions_delta) == (0.0, 0.0, 0)
    assert s0.queue_delay_ewma_s == 0.4 and s0.num_waiting_reqs == 2
    s1 = m.observe(snap(1.0, used=100, retractions=5))
    assert (s1.kv_usage, s1.kv_usage_ewma, s1.retractions_delta) == (1.0, 0.5, 0)
    assert s1.queue_delay_ewma_s == pytest.approx(0.2)
    s2 = m.observe(snap(2.0, used=100, retractions=8))
    assert (s2.kv_usage_ewma, s2.retractions_delta) == (0.75, 3)
    assert m.observe(snap(3.0, used=0, cap=0, retractions=8)).kv_usage == 0.0
    assert (s2.kv_capacity_tokens, s2.kv_used_tokens, s2.num_running_reqs) == (100, 100, 1)


def test_monitor_latency_ewmas():
    m = PressureMonitor(ewma_alpha=0.5)
    s = m.observe(snap(0.0))
    assert s.ttft_ewma_s is None and s.tpot_ewma_s is None
    m.record_request_latency(1.0, None)
    s = m.observe(snap(0.1))
    assert s.ttft_ewma_s == 1.0 and s.tpot_ewma_s is None
    m.record_request_latency(3.0, 0.1)
    m.record_request_latency(None, 0.3)
    s = m.observe(snap(0.2))
    assert s.ttft_ewma_s == 2.0 and s.tpot_ewma_s == pytest.approx(0.2)


def test_monitor_validation():
    for kw in ({"used": -1}, {"waiting": -1}, {"head_wait_s": -0.1}, {"retractions": -1},
               {"head_wait_s": math.nan}, {"used": 101}):
        with pytest.raises(ValueError, match="PressureSnapshot"):
            snap(0.0, **kw)
    with pytest.raises(ValueError, match="ewma_alpha"):
        PressureMonitor(ewma_alpha=0.0)
    m = PressureMonitor()
    m.observe(snap(1.0, retractions=3))
    with pytest.raises(ValueError, match="backwards"):
        m.observe(snap(0.5, retractions=3))
    with pytest.raises(ValueError, match="decreased"):
        m.observe(snap(2.0, retractions=2))
    with pytest.raises(ValueError, match="ttft_s"):
        m.record_request_latency(-1.0, None)
    with pytest.raises(ValueError, match="tpot_s"):
        m.record_request_latency(None, -1.0)


def test_monitor_passes_admission_counters_through():
    m = PressureMonitor()
    s = m.observe(PressureSnapshot(0.0, 100, 40, 1, 2, 0.3, 0, kv_reserved_tokens=50,
                                   head_need_tokens=11))
    assert (s.kv_reserved_tokens, s.head_need_tokens) == (50, 11)
    assert s.head_blocked_by_kv  # 40 + 50 + 11 > 100
    with pytest.raises(ValueError, match="kv_reserved_tokens"):
        PressureSnapshot(0.0, 100, 40, 1, 2, 0.3, 0, kv_reserved_tokens=-1)


# --------------------------------------------------------------------------- operators


def test_pinned_layers_are_never_swapped_nor_restored():
    c = ctl()
    pinned = frozenset({0, 1})
    a = None
    for i in range(3):
        a = c.decide(sig(0.1 * i, 0.9), FULL8, pinned=pinned)
    assert a is not None and a.layers == (2, 3)
    # Layers 0 and 1 were quantized by an operator and stay there through a long quiet spell,
    # while the controller's own layers come back.
    bits = apply(apply(FULL8, a), SwapLayers((0, 1), 4, "operator"))
    restored = []
    for i in range(80):
        r = c.decide(sig(1 + 0.5 * i, 0.0), bits, pinned=pinned)
        if r is not None:
            restored.append(r)
            bits = apply(bits, r)
    assert restored and all(set(r.layers).isdisjoint(pinned) for r in restored)
    assert bits == (4, 4) + (16,) * 6
    # Unpinned, the same quiet spell restores them.
    more = [r for i in range(40) if (r := c.decide(sig(50 + 0.5 * i, 0.0), bits)) is not None]
    assert more and set(more[0].layers) == {0, 1}


def test_an_external_transition_restarts_cooldown_and_quiet_window():
    c = ctl()
    bits = apply(FULL8, SwapLayers((0, 1), 4, "operator"))
    # Quiet for 4.9 s, then an operator transition: the restore needs a fresh quiet window.
    for i in range(50):
        assert c.decide(sig(0.1 * i, 0.0), bits) is None
    c.note_transition(4.95)
    quiet = [sig(5.0 + 0.1 * i, 0.0) for i in range(49)]
    assert all(c.decide(s, bits) is None for s in quiet)  # only 4.8 s since the transition
    actions, _ = drive(c, bits, [sig(10.0 + 0.1 * i, 0.0) for i in range(20)])
    assert actions and actions[0][0] >= 4.95 + RULES.restore_quiet_s


def test_monitor_step_length_from_busy_scheduler_iterations():
    m = PressureMonitor(ewma_alpha=0.5)

    def obs(t, steps, running=1, release=()):
        return m.observe(PressureSnapshot(t, 100, 10, 0, running, 0.0, 0,
                                          scheduler_steps_total=steps,
                                          running_kv_release=release))

    assert obs(0.0, 0).step_s == 0.0  # nothing to compare with yet
    assert obs(1.0, 10).step_s == pytest.approx(0.1)  # 10 iterations in 1 s
    assert obs(2.0, 15).step_s == pytest.approx(0.15)  # EWMA of 0.1 and 0.2
    # Idle stretches (a second per iteration with --sleep-on-idle) say nothing about a step.
    assert obs(10.0, 20, running=0).step_s == pytest.approx(0.15)
    assert obs(11.0, 21).step_s == pytest.approx(0.15)
    # Running requests' releases come out nearest finish first.
    assert obs(12.0, 31, release=((30, 5), (2, 7))).running_kv_release == ((2, 7), (30, 5))
    with pytest.raises(ValueError, match="scheduler_steps_total decreased"):
        obs(13.0, 3)
    with pytest.raises(ValueError, match="running_kv_release"):
        PressureSnapshot(0.0, 100, 10, 0, 1, 0.0, 0, running_kv_release=((-1, 5),))
