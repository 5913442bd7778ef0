"""Spread values and per-window permutations (hdet_megatron.spread)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from fractions import Fraction

import numpy
import pytest
import torch

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.spread import (
    arm_axis_value,
    arm_spread,
    arm_values,
    linear_multipliers,
    log_multipliers,
    slot_offsets,
    slot_values,
    window_permutation,
)

ALPHAS = [0.0, 1.0 / 9.0, 0.05, 0.1, 0.25, 0.3, 0.5, 0.75, 0.9, 0.999]


def test_linear_multipliers_paper_values():
    assert linear_multipliers(1, 1 / 9) == [1.0]
    assert linear_multipliers(2, 0.5) == [0.5, 1.5]
    assert linear_multipliers(3, 0.5) == [0.5, 1.0, 1.5]
    assert linear_multipliers(5, 0.5) == [0.5, 0.75, 1.0, 1.25, 1.5]
    m = linear_multipliers(8, 1 / 9)
    assert m[0] == pytest.approx(8 / 9, abs=1e-15) and m[-1] == pytest.approx(10 / 9, abs=1e-15)
    assert all(b > a for a, b in zip(m, m[1:], strict=False))  # increasing, evenly spaced
    steps = [b - a for a, b in zip(m, m[1:], strict=False)]
    assert max(steps) - min(steps) < 1e-15
    assert linear_multipliers(6, 0.0) == [1.0] * 6


@pytest.mark.parametrize("n", list(range(1, 70)) + [127, 128, 255, 256, 1000, 1023, 1024])
def test_linear_mean_exactly_one_and_symmetric(n):
    rng = random.Random(n)
    for alpha in ALPHAS + [rng.random() * 0.99 for _ in range(10)]:
        m = linear_multipliers(n, alpha)
        assert len(m) == n
        assert math.fsum(m) / n == 1.0, (n, alpha)
        for r in range(n):
            assert m[r] - 1.0 == -(m[n - 1 - r] - 1.0)  # exact mirror around 1
        for r in range(0, n, max(1, n // 64)):  # within one ulp of 1 of the exact rational
            exact = 1 + Fraction(alpha) * Fraction(2 * r - (n - 1), 2) / max(
                Fraction(n - 1, 2), Fraction(1, 2)
            )
            assert abs(Fraction(m[r]) - exact) <= Fraction(1, 2**52)
        assert min(m) >= 1 - alpha - 1e-15 and max(m) <= 1 + alpha + 1e-15


def test_linear_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        linear_multipliers(4, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        linear_multipliers(4, -0.1)
    with pytest.raises(ValueError, match="alpha"):
        linear_multipliers(4, float("nan"))
    with pytest.raises(ValueError, match="n="):
        linear_multipliers(0, 0.1)
    with pytest.raises(ValueError, match="n="):
        linear_multipliers(2.0, 0.1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 64, 1024])
def test_log_multipliers_log_symmetric(n):
    for alpha in (0.0, 0.1, 0.5, 1.0, 2.0):
        m = log_multipliers(n, alpha)
        logs = slot_offsets(n, alpha)
        assert m == [math.exp(x) for x in logs]
        for r in range(n):
            assert logs[r] == -logs[n - 1 - r]
            assert m[r] * m[n - 1 - r] == pytest.approx(1.0, rel=1e-15)
        assert math.exp(math.fsum(math.log(x) for x in m) / n) == pytest.approx(1.0, abs=1e-15)
        assert m[0] == pytest.approx(math.exp(-alpha) if n > 1 else 1.0)
    assert log_multipliers(1, 0.7) == [1.0]


def test_slot_values_per_axis_kind():
    assert slot_values(Axis("lr", 0.5), 3) == [0.5, 1.0, 1.5]
    assert slot_values(Axis("lr:embedding", 0.5), 3) == [0.5, 1.0, 1.5]
    assert slot_values(Axis("weight_decay", 0.5, kind="log"), 3) == [math.exp(-0.5), 1.0, math.exp(0.5)]
    dropout = slot_values(Axis("dropout", 0.05), 5)
    assert dropout == [-0.05, -0.025, 0.0, 0.025, 0.05]
    for n in range(1, 50):
        assert math.fsum(slot_values(Axis("dropout", 0.07), n)) == 0.0


def test_window_permutation_valid_and_deterministic():
    for n in (1, 2, 3, 8, 100, 1024):
        for window in (0, 1, 17, 10**9):
            perm = window_permutation(3, window, "lr", n)
            assert sorted(perm) == list(range(n))
            assert window_permutation(3, window, "lr", n) == perm
    # Known values: the stream format is part of the resume contract (see _PERM_STREAM).
    assert window_permutation(0, 0, "lr", 8) == [1, 4, 7, 5, 3, 6, 0, 2]
    assert window_permutation(0, 1, "lr", 8) == [0, 6, 5, 3, 2, 7, 1, 4]


def test_window_permutation_varies_with_key():
    n = 16
    base = window_permutation(0, 5, "lr", n)
    assert window_permutation(0, 6, "lr", n) != base
    assert window_permutation(1, 5, "lr", n) != base
    assert window_permutation(0, 5, "dropout", n) != base
    # Many windows: every slot visits every arm about equally often (a fresh draw per window).
    counts = [[0] * 8 for _ in range(8)]
    for window in range(4000):
        for arm, slot in enumerate(window_permutation(7, window, "lr", 8)):
            counts[arm][slot] += 1
    assert all(400 < c < 600 for row in counts for c in row)


def test_two_axes_get_independent_permutations():
    config = HDETConfig(axes=(Axis("lr", 0.1), Axis("dropout", 0.05)))
    same = 0
    for window in range(200):
        a = window_permutation(config.seed, window, "lr", 8)
        b = window_permutation(config.seed, window, "dropout", 8)
        same += a == b
    assert same == 0  # 8! = 40320 permutations: a coincidence in 200 windows is ~0.5%
    spreads = arm_spread(config, 8, 3)
    assert set(spreads) == {"lr", "dropout"}
    # Arm r's lr slot and dropout slot are not the same index in every window.
    lr_slots = [linear_multipliers(8, 0.1).index(x) for x in spreads["lr"]]
    drop_slots = [slot_offsets(8, 0.05).index(x) for x in spreads["dropout"]]
    assert lr_slots != drop_slots


def test_permutation_leaves_global_rngs_untouched():
    random.seed(123)
    numpy.random.seed(123)
    torch.manual_seed(123)
    py_state = random.getstate()
    np_state = numpy.random.get_state()
    torch_state = torch.get_rng_state().clone()
    config = HDETConfig(axes=(Axis("lr", 0.1), Axis("dropout", 0.05)))
    for window in range(50):
        window_permutation(window, window, "lr", 64)
        arm_spread(config, 8, window)
    assert random.getstate() == py_state
    after = numpy.random.get_state()
    assert after[0] == np_state[0] and (after[1] == np_state[1]).all() and after[2:] == np_state[2:]
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_permutations_identical_in_a_separate_process():
    code = (
        "import json, random; random.seed(99)\n"
        "from hdet_megatron.spread import window_permutation\n"
        "print(json.dumps([window_permutation(5, w, a, 13) for w in range(20) for a in ('lr', 'dropout')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = [window_permutation(5, w, a, 13) for w in range(20) for a in ("lr", "dropout")]
    assert json.loads(out.stdout) == here


def test_window_permutation_rejects_bad_keys():
    with pytest.raises(ValueError, match="seed"):
        window_permutation(-1, 0, "lr", 4)
    with pytest.raises(ValueError, match="window"):
        window_permutation(0, -1, "lr", 4)
    with pytest.raises(ValueError, match="axis_name"):
        window_permutation(0, 0, "", 4)
    with pytest.raises(ValueError, match="n="):
        window_permutation(0, 0, "lr", 0)


def test_arm_values_apply_the_permutation():
    axis = Axis("lr", 0.3)
    for window in range(5):
        perm = window_permutation(11, window, "lr", 4)
        slots = slot_values(axis, 4)
        values = arm_values(axis, 4, 11, window)
        assert values == [slots[p] for p in perm]
        assert sorted(values) == slots
        assert math.fsum(values) / 4 == 1.0


def test_arm_spread_uses_config_seed():
    config = HDETConfig(axes=(Axis("lr", 0.2),), seed=42)
    assert arm_spread(config, 6, 9) == {"lr": arm_values(Axis("lr", 0.2), 6, 42, 9)}
    assert arm_spread(config, 1, 0) == {"lr": [1.0]}


def test_arm_axis_value_bounds():
    lr = Axis("lr", 0.1, min=1e-5, max=1e-3)
    assert arm_axis_value(lr, 1e-4, 2.0, 1.1) == pytest.approx(2.2e-4)
    assert arm_axis_value(lr, 1e-3, 2.0, 1.1) == 1e-3
    assert arm_axis_value(lr, 1e-6, 1.0, 0.9) == 1e-5
    drop = Axis("dropout", 0.05, min=0.0, max=0.3)
    assert arm_axis_value(drop, 0.1, -0.02, 0.05) == pytest.approx(0.13)
    assert arm_axis_value(drop, 0.02, 0.0, -0.05) == 0.0
