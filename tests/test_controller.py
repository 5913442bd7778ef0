"""The auto controller (hdet_megatron.controller): hand-computed updates and edge cases."""

from __future__ import annotations

import copy
import json
import math

import pytest

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.controller import (
    AllArmsNonFinite,
    AutoController,
    ControllerUpdate,
    NonFiniteArm,
    softmax_weights,
)
from hdet_megatron.spread import arm_spread, linear_multipliers, slot_offsets

NAN, INF = float("nan"), float("inf")

# The 4-arm case used throughout: rho = [0.7, 0.9, 1.1, 1.3] (alpha 0.3), losses 1.0 .. 1.3,
# sigma 0.1, so the scores are (L_bar - L_r)/sigma = [1.5, 0.5, -0.5, -1.5] and the softmax
# weights are [1, e^-1, e^-2, e^-3] / (1 + e^-1 + e^-2 + e^-3).
RHO = [0.7, 0.9, 1.1, 1.3]
LOSSES = [1.0, 1.1, 1.2, 1.3]
Z = 1 + math.exp(-1) + math.exp(-2) + math.exp(-3)
W = [1 / Z, math.exp(-1) / Z, math.exp(-2) / Z, math.exp(-3) / Z]
DELTA = sum(w * r for w, r in zip(W, RHO, strict=True)) - 1  # = -0.198530546917...


def make(**kw) -> AutoController:
    kw.setdefault("axes", (Axis("lr", 0.3),))
    # The update rules by hand: the guards (tests/test_guards.py) off unless a test turns them on.
    kw.setdefault("brake", False)
    num_arms = kw.pop("num_arms", 4)
    return AutoController(HDETConfig(**kw), num_arms)


def test_spread_of_the_hand_case():
    assert linear_multipliers(4, 0.3) == pytest.approx(RHO, abs=1e-15)
    assert DELTA == pytest.approx(-0.19853054691715397, rel=1e-12)


def test_relative_rule_hand_computed():
    ctl = make()
    assert ctl.scale("lr") == 1.0 and ctl.velocity("lr") == 0.0 and ctl.window == 0
    # Arms listed in a shuffled order: what matters is which multiplier went with which loss.
    up = ctl.update([1.2, 1.0, 1.3, 1.1], {"lr": [1.1, 0.7, 1.3, 0.9]}, step=1000)
    assert isinstance(up, ControllerUpdate)
    assert up.window == 0 and up.moved and up.step == 1000 and up.excluded == []
    assert up.sigma == 0.1
    assert up.weights == pytest.approx([W[2], W[0], W[3], W[1]], rel=1e-12)
    assert up.deltas["lr"] == pytest.approx(DELTA, rel=1e-12)
    v = (1 - 0.9) * DELTA  # beta = 0.9
    c = 1 * (1 + 0.5 * v)  # lambda = 0.5
    assert up.velocities["lr"] == pytest.approx(v, rel=1e-12)
    assert up.scales["lr"] == pytest.approx(c, rel=1e-12)
    assert c == pytest.approx(0.9900734726541423, rel=1e-12)
    assert ctl.scale("lr") == up.scales["lr"] and ctl.velocity("lr") == up.velocities["lr"]
    assert ctl.window == 1 and ctl.num_updates == 1


def test_paper_rule_hand_computed():
    ctl = make(rule="paper")
    base1, base2 = 2e-3, 1e-3  # the base schedule decays between the two converges
    up1 = ctl.update(LOSSES, {"lr": RHO}, step=1000, base_values={"lr": base1})
    # h_r = base * c * rho_r; Delta = sum w h - mean h, in LR units.
    d1 = sum(w * base1 * r for w, r in zip(W, RHO, strict=True)) - base1
    v1 = 0.1 * d1
    c1 = (base1 * 1.0 + 0.5 * v1) / base1
    assert up1.deltas["lr"] == pytest.approx(d1, rel=1e-12)
    assert up1.velocities["lr"] == pytest.approx(v1, rel=1e-12)
    assert up1.scales["lr"] == pytest.approx(c1, rel=1e-12)
    # With c = 1 and a constant base the paper rule equals the relative rule.
    assert c1 == pytest.approx(1 + 0.5 * 0.1 * DELTA, rel=1e-12)
    # Reversed losses: the best arm is now the largest multiplier.
    up2 = ctl.update(LOSSES[::-1], {"lr": RHO}, step=2000, base_values={"lr": base2})
    h = [base2 * c1 * r for r in RHO]
    d2 = sum(w * x for w, x in zip(W[::-1], h, strict=True)) - sum(h) / 4
    v2 = 0.9 * v1 + 0.1 * d2
    c2 = (base2 * c1 + 0.5 * v2) / base2
    assert up2.deltas["lr"] == pytest.approx(d2, rel=1e-12)
    assert up2.velocities["lr"] == pytest.approx(v2, rel=1e-12)
    assert up2.scales["lr"] == pytest.approx(c2, rel=1e-12)


def test_paper_rule_needs_base_values():
    ctl = make(rule="paper")
    with pytest.raises(ValueError, match="base_values"):
        ctl.update(LOSSES, {"lr": RHO}, step=1000)
    with pytest.raises(ValueError, match="base_values"):
        ctl.update(LOSSES, {"lr": RHO}, step=1000, base_values={"lr": NAN})
    # Before auto_start nothing moves, so no base is needed.
    gated = make(rule="paper", auto_start=5000)
    assert not gated.update(LOSSES, {"lr": RHO}, step=1000).moved


def test_momentum_accumulates():
    ctl = make()
    c, v = 1.0, 0.0
    for k in range(3):
        up = ctl.update(LOSSES, {"lr": RHO}, step=1000 * (k + 1))
        v = 0.9 * v + 0.1 * DELTA
        c = c * (1 + 0.5 * v)
        assert up.velocities["lr"] == pytest.approx(v, rel=1e-12)
        assert up.scales["lr"] == pytest.approx(c, rel=1e-12)
    assert v == pytest.approx(0.271 * DELTA, rel=1e-12)
    # A neutral window afterwards: Delta = 0, but the velocity keeps moving the scale.
    up = ctl.update([2.0] * 4, {"lr": RHO}, step=4000)
    assert up.deltas["lr"] == 0.0
    assert up.velocities["lr"] == pytest.approx(0.9 * v, rel=1e-12)
    assert up.scales["lr"] == pytest.approx(c * (1 + 0.5 * 0.9 * v), rel=1e-12)


def test_scale_is_clamped_to_bounds():
    low = make(meta_lr=50.0, scale_bounds=(0.5, 2.0))
    assert low.update(LOSSES, {"lr": RHO}, step=0).scales["lr"] == 0.5
    high = make(meta_lr=100.0, scale_bounds=(0.5, 2.0))
    assert high.update(LOSSES[::-1], {"lr": RHO}, step=0).scales["lr"] == 2.0
    # 1 + lambda v <= 0 would flip the sign of the LR: the default lower bound catches it.
    flip = make(meta_lr=1000.0)
    assert flip.update(LOSSES, {"lr": RHO}, step=0).scales["lr"] == 0.01
    paper = make(meta_lr=1000.0, rule="paper")
    assert paper.update(LOSSES, {"lr": RHO}, step=0, base_values={"lr": 1e-3}).scales["lr"] == 0.01


def test_auto_off_and_auto_start_gate_the_update():
    off = make(auto=False)
    up = off.update(LOSSES, {"lr": RHO}, step=10**6)
    assert not up.moved
    assert up.weights == pytest.approx(W, rel=1e-12)  # still computed and reported
    assert up.deltas["lr"] == pytest.approx(DELTA, rel=1e-12)
    assert up.scales == {"lr": 1.0} and up.velocities == {"lr": 0.0}
    assert off.num_updates == 0 and off.window == 1

    gated = make(auto_start=3000)
    assert not gated.update(LOSSES, {"lr": RHO}, step=2999).moved
    assert gated.scale("lr") == 1.0 and gated.velocity("lr") == 0.0
    up = gated.update(LOSSES, {"lr": RHO}, step=3000)
    assert up.moved and up.window == 1
    assert up.scales["lr"] == pytest.approx(1 + 0.05 * DELTA, rel=1e-12)
    assert gated.num_updates == 1 and gated.window == 2


def test_nonfinite_arms_get_weight_zero():
    ctl = make()
    up = ctl.update([1.0, NAN, 1.2, INF], {"lr": RHO}, step=0)
    assert up.excluded == [1, 3]
    # Softmax over the finite arms only: L_bar = 1.1, scores [1, -1].
    w0, w2 = 1 / (1 + math.exp(-2)), math.exp(-2) / (1 + math.exp(-2))
    assert up.weights == pytest.approx([w0, 0.0, w2, 0.0], rel=1e-12)
    assert up.weights[1] == 0.0 and up.weights[3] == 0.0
    assert up.deltas["lr"] == pytest.approx(w0 * 0.7 + w2 * 1.1 - 1, rel=1e-12)
    assert math.isfinite(ctl.scale("lr"))
    assert json.loads(json.dumps(up.to_dict()))["arm_losses"] == [1.0, "nan", 1.2, "inf"]
    assert make().update([-INF, 1.0, 1.0, 1.0], {"lr": RHO}, step=0).excluded == [0]


def test_all_nonfinite_raises_and_leaves_state_alone():
    ctl = make()
    ctl.update(LOSSES, {"lr": RHO}, step=0)
    before = ctl.state_dict()
    with pytest.raises(AllArmsNonFinite, match="all 4 arms"):
        ctl.update([NAN, INF, NAN, -INF], {"lr": RHO}, step=1000)
    assert ctl.state_dict() == before


def test_nonfinite_raise_mode_names_the_arm():
    ctl = make(nonfinite="raise")
    with pytest.raises(NonFiniteArm, match=r"arm\(s\) \[2\]"):
        ctl.update([1.0, 1.1, NAN, 1.3], {"lr": RHO}, step=0)
    assert ctl.window == 0 and ctl.scale("lr") == 1.0
    with pytest.raises(AllArmsNonFinite):
        ctl.update([NAN] * 4, {"lr": RHO}, step=0)


def test_sigma_auto_uses_the_std_of_the_losses():
    ctl = make(temperature="auto")
    up = ctl.update(LOSSES, {"lr": RHO}, step=0)
    std = math.sqrt(0.0125)  # deviations +-0.15, +-0.05
    assert up.sigma == pytest.approx(std, rel=1e-12)
    expected = [math.exp(-(x - 1.0) / std) for x in LOSSES]
    assert up.weights == pytest.approx([e / sum(expected) for e in expected], rel=1e-12)
    # Scale-free: shifting and scaling the losses gives the same weights.
    w2, _, _ = softmax_weights([5 + 1000 * x for x in LOSSES], "auto")
    assert w2 == pytest.approx(up.weights, rel=1e-9)


def test_sigma_auto_guards():
    # All equal: std 0 -> uniform weights, Delta exactly 0.
    ctl = make(temperature="auto")
    up = ctl.update([0.5] * 4, {"lr": RHO}, step=0)
    assert up.sigma == 0.0 and up.weights == [0.25] * 4 and up.deltas == {"lr": 0.0}
    assert ctl.scale("lr") == 1.0
    # One finite arm: all the weight on it.
    w, excluded, sigma = softmax_weights([NAN, 2.0, INF, NAN], "auto")
    assert w == [0.0, 1.0, 0.0, 0.0] and excluded == [0, 2, 3] and sigma == 0.0
    # Huge but finite losses do not overflow.
    w, _, sigma = softmax_weights([1.0, 1e308, 1.7e308, -1e308], "auto")
    assert all(math.isfinite(x) for x in w) and math.isfinite(sigma) and sum(w) == pytest.approx(1)
    w, _, _ = softmax_weights([1.0, 1.7e308, -1.7e308, 0.0], 0.1)
    assert w == [0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("rule", ["relative", "paper"])
@pytest.mark.parametrize("temperature", [0.1, "auto"])
@pytest.mark.parametrize("kind", ["linear", "log"])
def test_neutral_controller_never_moves_the_scale(rule, temperature, kind):
    """Paper-code defect 3: its gamma made the LR grow ~400x with no signal at all. Here equal
    losses give Delta == 0 exactly, in every window, for every arm count, and the effective
    LR base(t) * c follows the decaying base schedule."""
    for n in (1, 2, 3, 8, 64):
        config = HDETConfig(axes=(Axis("lr", 0.5, kind=kind),), temperature=temperature, rule=rule)
        ctl = AutoController(config, n)
        for window in range(100):
            base = 1e-3 * (1 - window / 100) + 1e-6  # decaying schedule
            losses = [3.0 + window * 1e-3] * n
            up = ctl.update(
                losses, arm_spread(config, n, ctl.window), step=window * 1000, base_values={"lr": base}
            )
            assert up.deltas == {"lr": 0.0}
        assert ctl.scale("lr") == 1.0 and ctl.velocity("lr") == 0.0


def test_additive_axis_shift():
    config = HDETConfig(axes=(Axis("lr", 0.3), Axis("dropout", 0.06, min=0.0, max=0.3)))
    ctl = AutoController(config, 4)
    assert ctl.scale("dropout") == 0.0
    d = slot_offsets(4, 0.06)  # [-0.06, -0.02, 0.02, 0.06]
    # The lr axis used the slots in reverse order: the two axes get independent Deltas.
    up = ctl.update(LOSSES, {"lr": RHO[::-1], "dropout": d}, step=0)
    delta_d = sum(w * x for w, x in zip(W, d, strict=True)) - sum(d) / 4
    delta_lr = sum(w * x for w, x in zip(W, RHO[::-1], strict=True)) - 1
    assert up.deltas["dropout"] == pytest.approx(delta_d, rel=1e-12)
    assert up.deltas["lr"] == pytest.approx(delta_lr, rel=1e-12)
    assert up.velocities == pytest.approx({"lr": 0.1 * delta_lr, "dropout": 0.1 * delta_d}, rel=1e-12)
    assert up.scales["dropout"] == pytest.approx(0.5 * 0.1 * delta_d, rel=1e-12)
    assert up.scales["lr"] == pytest.approx(1 + 0.05 * delta_lr, rel=1e-12)
    # With a base value the shift keeps base + shift inside [min, max].
    big = AutoController(config.replace(meta_lr=1000.0), 4)
    up = big.update(LOSSES, {"lr": RHO, "dropout": d}, step=0, base_values={"dropout": 0.1})
    assert up.scales["dropout"] == pytest.approx(-0.1)  # base + shift == min == 0


def test_cut_scale():
    config = HDETConfig(axes=(Axis("lr", 0.3), Axis("dropout", 0.05)))
    ctl = AutoController(config, 4)
    ctl.update(LOSSES, {"lr": RHO, "dropout": slot_offsets(4, 0.05)}, step=0)
    c, shift = ctl.scale("lr"), ctl.scale("dropout")
    ctl.cut_scale()
    assert ctl.scale("lr") == c * 0.5 and ctl.scale("dropout") == shift
    assert ctl.velocities() == {"lr": 0.0, "dropout": 0.0}
    for _ in range(20):
        ctl.cut_scale(0.1)
    assert ctl.scale("lr") == 0.01  # clamped at c_min
    with pytest.raises(ValueError, match="factor"):
        ctl.cut_scale(0.0)


def test_bad_update_input():
    ctl = make()
    with pytest.raises(ValueError, match="3 arm losses for 4 arms"):
        ctl.update(LOSSES[:3], {"lr": RHO}, step=0)
    with pytest.raises(ValueError, match="axes"):
        ctl.update(LOSSES, {"dropout": RHO}, step=0)
    with pytest.raises(ValueError, match=r"arm_spreads\['lr'\] has 3 values"):
        ctl.update(LOSSES, {"lr": RHO[:3]}, step=0)
    with pytest.raises(ValueError, match="must be > 0"):
        ctl.update(LOSSES, {"lr": [0.0, 1.0, 1.0, 2.0]}, step=0)
    with pytest.raises(ValueError, match="step"):
        ctl.update(LOSSES, {"lr": RHO}, step=1.5)
    with pytest.raises(KeyError, match="unknown axis"):
        ctl.scale("dropout")
    with pytest.raises(ValueError, match="num_arms"):
        AutoController(HDETConfig(), 0)
    assert ctl.window == 0


def _history(ctl: AutoController, start: int, count: int) -> list[ControllerUpdate]:
    out = []
    for k in range(start, start + count):
        losses = [1.0 + 0.01 * ((k * 7 + r * 3) % 5) for r in range(4)]
        out.append(ctl.update(losses, arm_spread(ctl.config, 4, ctl.window), step=1000 * k))
    return out


def test_state_dict_round_trip_continues_identically():
    config = HDETConfig(axes=(Axis("lr", 0.3), Axis("dropout", 0.05)), temperature="auto", seed=3)
    a = AutoController(config, 4)
    _history(a, 0, 5)
    state = json.loads(json.dumps(a.state_dict()))  # plain data only
    assert state["window"] == 5 and state["num_updates"] == 5 and state["num_arms"] == 4
    assert state["config"] == a.config.fingerprint() == config.resolve(False, 4).config.fingerprint()
    b = AutoController(config, 4)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert _history(a, 5, 5) == _history(b, 5, 5)
    assert a.scales() == b.scales() and a.velocities() == b.velocities()


def test_load_state_dict_errors_name_the_problem():
    config = HDETConfig(axes=(Axis("lr", 0.3),))
    good = make().state_dict()

    def broken(edit):
        state = copy.deepcopy(good)
        edit(state)
        return state

    cases = [
        (broken(lambda s: s.pop("window")), "missing key 'window'"),
        (broken(lambda s: s.update(window="3")), r"state\['window'\]='3' must be an integer"),
        (broken(lambda s: s.update(num_updates=True)), r"'num_updates'\]=True"),
        (broken(lambda s: s.update(version=99)), "version 99"),
        (broken(lambda s: s["axes"]["lr"].update(scale=NAN)), r"\['lr'\]\['scale'\]=nan is not finite"),
        (broken(lambda s: s["axes"]["lr"].update(velocity="x")), r"\['velocity'\]='x' must be a number"),
        (broken(lambda s: s["axes"]["lr"].update(scale=-1.0)), r"\['scale'\]=-1.0 must be > 0"),
        (broken(lambda s: s["axes"]["lr"].pop("velocity")), "missing key 'velocity'"),
        (broken(lambda s: s.update(axes={"dropout": {"scale": 0.0, "velocity": 0.0}})), "do not match"),
        (broken(lambda s: s.update(axes=[1])), "must be a dict"),
        ([1, 2], "must be a dict"),
    ]
    for state, message in cases:
        ctl = AutoController(config, 4)
        with pytest.raises(ValueError, match=message):
            ctl.load_state_dict(state)
        assert ctl.scale("lr") == 1.0 and ctl.window == 0  # unchanged on error


def test_load_state_dict_clamps_to_current_bounds():
    state = make(meta_lr=100.0, scale_bounds=(0.5, 3.0))
    state.update(LOSSES[::-1], {"lr": RHO}, step=0)
    narrow = make(scale_bounds=(0.5, 1.5))
    narrow.load_state_dict(state.state_dict())
    assert narrow.scale("lr") == 1.5
