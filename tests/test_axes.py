"""Several axes: independent permutations, independent controller states, and the --hdet-* flags."""

from __future__ import annotations

import argparse
import math

import pytest

from hdet_megatron.args import add_hdet_args, hdet_config_from_args
from hdet_megatron.config import Axis, HDETConfig, HDETConfigError
from hdet_megatron.controller import AutoController
from hdet_megatron.spread import arm_spread, linear_multipliers, window_permutation


def test_two_axes_have_independent_permutations():
    config = HDETConfig(axes=(Axis("lr", 0.2), Axis("weight_decay", 0.5)))
    n, windows = 8, 200
    same = 0
    for w in range(windows):
        a = window_permutation(config.seed, w, "lr", n)
        b = window_permutation(config.seed, w, "weight_decay", n)
        same += a == b
        # Each axis' arm values are its own slots under its own permutation (arm r: slot a[r]).
        spread = arm_spread(config, n, w)
        assert spread["lr"] == [linear_multipliers(n, 0.2)[p] for p in a]
        assert spread["weight_decay"] == [linear_multipliers(n, 0.5)[p] for p in b]
    assert same == 0  # 1/8! chance per window


def test_only_the_axis_that_matters_moves():
    """Loss depends on the LR only; the weight-decay axis must stay near its start."""
    config = HDETConfig(
        period=10,
        axes=(Axis("lr", 0.3), Axis("weight_decay", 0.3)),
        temperature="auto",
        meta_lr=0.5,
        momentum=0.9,
    )
    n = 8
    controller = AutoController(config, n)
    optimum = 4.0  # base LR 1.0 is 4x too low
    for window in range(80):
        spread = arm_spread(config, n, window)
        losses = []
        for r in range(n):
            lr = controller.scale("lr") * spread["lr"][r]
            losses.append(math.log(lr / optimum) ** 2)
        controller.update(losses, spread, step=(window + 1) * config.period)
    assert controller.scale("lr") > 2.5
    assert abs(math.log(controller.scale("weight_decay"))) < 0.15


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_hdet_args(parser)
    return hdet_config_from_args(parser.parse_args(argv))


def test_flags_defaults_and_every_field():
    assert _parse([]) == HDETConfig()
    assert _parse(["--no-hdet"]) is None
    cfg = _parse(
        [
            "--hdet-period",
            "50",
            "--hdet-arms",
            "4",
            "--hdet-grad-sync",
            "arm",
            "--hdet-axis",
            "lr:no_wd:0.2",
            "--hdet-axis",
            "dropout:0.05:0:0.3",
            "--hdet-axis",
            "attention_temperature:0.1",
            "--no-hdet-auto",
            "--hdet-auto-start",
            "100",
            "--hdet-temperature",
            "auto",
            "--hdet-meta-lr",
            "0.3",
            "--hdet-momentum",
            "0.5",
            "--hdet-scale-bounds",
            "0.1",
            "10",
            "--hdet-rule",
            "paper",
            "--hdet-seed",
            "7",
            "--hdet-bucket-mb",
            "8",
            "--no-hdet-converge-on-save",
            "--hdet-nonfinite",
            "raise",
            "--hdet-rollback",
            "--hdet-spread-kind",
            "log",
        ]
    )
    assert cfg == HDETConfig(
        period=50,
        arms=4,
        grad_sync="arm",
        axes=(
            Axis("lr:no_wd", 0.2, kind="log"),
            Axis("dropout", 0.05, min=0.0, max=0.3),
            Axis("attention_temperature", 0.1, kind="log"),
        ),
        auto=False,
        auto_start=100,
        temperature="auto",
        meta_lr=0.3,
        momentum=0.5,
        scale_bounds=(0.1, 10.0),
        rule="paper",
        seed=7,
        bucket_mb=8.0,
        converge_on_save=False,
        nonfinite="raise",
        rollback=True,
    )
    assert _parse(["--hdet-spread", "0.3"]).axes == (Axis("lr", 0.3),)
    assert _parse(["--hdet-line-width", "0.2"]) == HDETConfig(line_width=0.2)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--hdet-spread", "0.2", "--hdet-axis", "lr:0.1"], "conflict"),
        (["--hdet-axis", "bogus:0.1"], "not a known axis"),
        (["--hdet-axis", "lr:0.1", "--hdet-axis", "lr:0.2"], "twice"),
        (["--hdet-axis", "dropout:0.1:0:1.5"], "leave [0, 1)"),
        (["--hdet-axis", "attention_temperature:0.1:0:2"], "temperature <= 0"),
        (["--hdet-period", "0"], "HDETConfig.period"),
        (["--hdet-temperature", "-1"], "HDETConfig.temperature"),
        (["--hdet-axis", "lr:1.5"], "multiplier <= 0"),
        (["--hdet-line-width", "1"], "--hdet-line-width: HDETConfig.line_width=1.0"),
        (["--hdet-line-width", "0.3", "--hdet-signal", "train"], "only a line signal"),
    ],
)
def test_bad_flags_name_the_problem(argv, needle):
    with pytest.raises(HDETConfigError, match=None) as info:
        _parse(argv)
    assert needle in str(info.value)
