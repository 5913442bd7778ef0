"""HDETConfig / Axis validation, parse_axis and fingerprints (hdet_megatron.config)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hdet_megatron.config import (
    Axis,
    HDETConfig,
    HDETConfigError,
    axes_from_strings,
    parse_axis,
    short_run_caution,
)


def test_defaults_resolve_to_the_measured_defaults():
    config = HDETConfig()
    assert config.period == 1000 and config.arms is None and config.grad_sync == "global"
    assert config.signal == "auto" and config.rule == "auto" and config.axes is None
    assert config.meta_lr is None and config.momentum is None and config.start_scale is None
    assert not config.resolved and config.brake and config.noise_aware
    assert config.temperature == 0.1 and config.scale_bounds == (0.01, 100.0)
    assert config.nonfinite == "exclude" and not config.rollback
    # Without a probe: the paper's signal and the relative rule at the user's LR.
    paper = config.resolve(probe_available=False, num_arms=8)
    c = paper.config
    assert c.resolved and c.signal == "train" and c.rule == "relative" and c.axes == (Axis("lr", 1 / 9),)
    assert (c.meta_lr, c.momentum, c.start_scale) == (0.5, 0.9, 1.0)
    assert "no probe_fn" in paper.note and "'train'" in paper.note
    # With a probe and >= 3 arms: the measured best (BENCHMARKS.md section 3), started low.
    best = config.resolve(probe_available=True, num_arms=4)
    c = best.config
    assert c.signal == "average" and c.rule == "newton" and c.axes == (Axis("lr", 0.3),)
    assert (c.meta_lr, c.momentum, c.start_scale) == (1.0, 0.5, 0.25)
    assert "slow start at 0.25x" in best.note
    # The line is scored at the arms' own multipliers unless a width is given (opt-in, 3l).
    assert c.line_width is None
    narrow = HDETConfig(axes=(Axis("lr", 0.05),), line_width=0.3).resolve(True, 4).config
    assert narrow.axes == (Axis("lr", 0.05),) and narrow.line_width == 0.3 and narrow.signal == "average"
    assert HDETConfig(line_width=0.4).resolve(False, 4).config.line_width is None  # no line signal
    # Fewer than 3 arms, arm-local gradients or other axes: no line, so the paper's defaults.
    assert config.resolve(True, 2).config.signal == "train"
    assert "3 arms" in config.resolve(True, 2).note
    assert HDETConfig(grad_sync="arm").resolve(True, 4).config.signal == "train"
    two_axes = HDETConfig(axes=(Axis("lr", 0.2), Axis("dropout", 0.05)))
    assert two_axes.resolve(True, 4).config.signal == "train"
    # What the user set is kept; a resolved config resolves to itself with no note.
    mine = HDETConfig(signal="line", meta_lr=0.7, start_scale=0.5)
    c = mine.resolve(True, 4).config
    assert (c.signal, c.rule, c.meta_lr, c.momentum, c.start_scale) == ("line", "newton", 0.7, 0.5, 0.5)
    assert c.resolve(False, 4).config is c and c.resolve(False, 4).note == ""
    # Auto off: the scale stays at the user's LR (no slow start without a controller), and the
    # arms keep the paper's narrow spread (no line to fit; the wide one costs at a good LR).
    off = HDETConfig(auto=False).resolve(True, 4)
    assert off.config.start_scale == 1.0 and off.config.axes == (Axis("lr", 1 / 9),)
    assert off.note == "HDET defaults (auto-LR off): LR spread 0.111"
    assert HDETConfig(auto=False, axes=(Axis("lr", 0.3),)).resolve(True, 4).config.axes == (Axis("lr", 0.3),)


def test_short_runs_are_told_the_slow_start_needs_windows():
    slow = HDETConfig(period=20).resolve(probe_available=True, num_arms=4).config
    # 125 iterations = 6 windows (BENCHMARKS.md 3d: the climb from best/16 did not make it).
    note = short_run_caution(slow, 125)
    assert "only 6 windows of 20" in note and "period of 12 or less" in note and "start-scale 1" in note
    assert short_run_caution(slow, 200) == ""  # 10 windows: enough
    assert short_run_caution(slow, 199) != ""
    # auto_start iterations are not windows the controller can climb in.
    assert short_run_caution(slow.replace(auto_start=40), 220) != ""
    assert short_run_caution(slow, 0) == ""  # length unknown
    # No slow start, or no controller: nothing to climb.
    assert short_run_caution(slow.replace(start_scale=1.0), 60) == ""
    assert short_run_caution(slow.replace(auto=False), 60) == ""
    paper = HDETConfig(period=20).resolve(probe_available=False, num_arms=4).config
    assert short_run_caution(paper, 60) == ""


def test_line_signals_refuse_lr_bounds():
    # Clipped arms would leave the update line (issue 29 bug 5).
    with pytest.raises(HDETConfigError, match="unbounded 'lr' axis"):
        HDETConfig(signal="average", axes=(Axis("lr", 0.3, min=1e-5),))
    bounded = HDETConfig(axes=(Axis("lr", 0.3, max=1.0),))
    assert bounded.resolve(True, 4).config.signal == "train"


def test_guard_fields_are_validated():
    for changes, field in [
        ({"start_scale": 0.0}, "start_scale"),
        ({"start_scale": 1000.0}, "start_scale"),
        ({"brake": 1}, "brake"),
        ({"brake_factor": 1.0}, "brake_factor"),
        ({"brake_spike": 0.0}, "brake_spike"),
        ({"brake_rise": -1.0}, "brake_rise"),
        ({"brake_hold": -1}, "brake_hold"),
        ({"noise_aware": "yes"}, "noise_aware"),
        ({"warmup_hold": 0}, "warmup_hold"),
    ]:
        with pytest.raises(HDETConfigError, match=rf"HDETConfig\.{field}="):
            HDETConfig(**changes)


def test_old_fingerprints_resume_without_the_guards():
    old = HDETConfig(signal="train", rule="relative", axes=(Axis("lr", 1 / 9),), meta_lr=0.5, momentum=0.9)
    data = old.fingerprint()
    for key in ("start_scale", "brake", "noise_aware", "warmup_hold"):
        del data[key]
    restored = HDETConfig.from_fingerprint(data)
    assert restored.start_scale == 1.0 and not restored.brake and not restored.noise_aware
    assert not restored.warmup_hold
    assert restored.resolved


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"period": 0}, r"HDETConfig\.period=0"),
        ({"period": 1.5}, r"HDETConfig\.period=1\.5"),
        ({"period": True}, r"HDETConfig\.period=True"),
        ({"arms": 0}, r"HDETConfig\.arms=0"),
        ({"arms": -2}, r"HDETConfig\.arms=-2"),
        ({"temperature": 0}, r"HDETConfig\.temperature=0"),
        ({"temperature": -0.1}, r"HDETConfig\.temperature=-0\.1"),
        ({"temperature": float("nan")}, r"HDETConfig\.temperature=nan"),
        ({"temperature": "hot"}, r"HDETConfig\.temperature='hot'"),
        ({"scale_bounds": (2.0, 0.5)}, r"HDETConfig\.scale_bounds=\(2\.0, 0\.5\).*inverted"),
        ({"scale_bounds": (0.0, 10.0)}, r"HDETConfig\.scale_bounds"),
        ({"scale_bounds": (0.5,)}, r"HDETConfig\.scale_bounds"),
        ({"grad_sync": "ring"}, r"HDETConfig\.grad_sync='ring'"),
        ({"rule": "adam"}, r"HDETConfig\.rule='adam'"),
        ({"nonfinite": "ignore"}, r"HDETConfig\.nonfinite='ignore'"),
        ({"momentum": 1.0}, r"HDETConfig\.momentum=1\.0"),
        ({"meta_lr": -1.0}, r"HDETConfig\.meta_lr=-1\.0"),
        ({"auto": 1}, r"HDETConfig\.auto=1"),
        ({"auto_start": -5}, r"HDETConfig\.auto_start=-5"),
        ({"seed": -1}, r"HDETConfig\.seed=-1"),
        ({"bucket_mb": 0}, r"HDETConfig\.bucket_mb=0"),
        ({"converge_on_save": "yes"}, r"HDETConfig\.converge_on_save='yes'"),
        ({"rollback": None}, r"HDETConfig\.rollback=None"),
        ({"axes": ["lr"]}, r"HDETConfig\.axes"),
        ({"line_width": 0.0}, r"HDETConfig\.line_width=0\.0.*\(0, 1\)"),
        ({"line_width": 1.0}, r"HDETConfig\.line_width=1\.0"),
        ({"line_width": float("nan")}, r"HDETConfig\.line_width=nan"),
        ({"line_width": "wide"}, r"HDETConfig\.line_width='wide'"),
        ({"line_width": 0.3, "signal": "train"}, r"HDETConfig\.line_width=0\.3: only a line signal"),
        # Axis errors name the axis and its field.
        ({"axes": (Axis("lr", 1.0),)}, r"Axis\('lr'\)\.spread=1\.0 >= 1"),
        ({"axes": (Axis("lr", 1.5),)}, r"Axis\('lr'\)\.spread=1\.5 >= 1"),
        ({"axes": (Axis("lr", -0.1),)}, r"Axis\('lr'\)\.spread=-0\.1 is negative"),
        ({"axes": (Axis("lr", float("inf")),)}, r"Axis\('lr'\)\.spread=inf"),
        ({"axes": (Axis("lr", 0.1, kind="cubic"),)}, r"Axis\('lr'\)\.kind='cubic'"),
        ({"axes": (Axis("momentum", 0.1),)}, r"Axis\.name='momentum' is not a known axis"),
        ({"axes": (Axis("lr", 0.1), Axis("lr", 0.2))}, r"HDETConfig\.axes='lr'.*twice"),
        ({"axes": (Axis("lr", 0.1), Axis("lr:embedding", 0.2))}, r"HDETConfig\.axes=.*overlap"),
        ({"axes": (Axis("dropout", 0.1, min=0.5, max=0.1),)}, r"Axis\('dropout'\) bounds are inverted"),
        ({"axes": (Axis("dropout", 0.1, min="a"),)}, r"Axis\('dropout'\)\.min='a'"),
    ],
)
def test_validation_errors_name_the_field(changes, field):
    with pytest.raises(HDETConfigError, match=field):
        HDETConfig(**changes)


def test_valid_variants():
    assert HDETConfig(arms=1, period=1).arms == 1
    assert HDETConfig(temperature="auto").temperature == "auto"
    assert HDETConfig(axes=(Axis("lr", 2.0, kind="log"),)).axes[0].kind == "log"  # log: any spread
    assert HDETConfig(axes=(Axis("dropout", 0.0),)).axes[0].additive
    assert HDETConfig(axes=()).axes == ()
    # Lists (argparse, JSON) are stored as tuples.
    config = HDETConfig(axes=[Axis("lr", 0.1)], scale_bounds=[0.1, 10])
    assert config.axes == (Axis("lr", 0.1),) and config.scale_bounds == (0.1, 10)
    both = HDETConfig(axes=(Axis("lr:embedding", 0.1), Axis("lr:output", 0.2), Axis("weight_decay", 0.3)))
    assert [a.group for a in both.axes] == ["embedding", "output", None]
    assert HDETConfigError.__mro__[1] is ValueError
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.period = 3  # frozen


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lr:0.111", Axis("lr", 0.111)),
        ("lr:1e-1", Axis("lr", 0.1)),
        ("dropout:0.05:0:0.3", Axis("dropout", 0.05, min=0.0, max=0.3)),
        ("dropout:0.05::0.3", Axis("dropout", 0.05, max=0.3)),
        ("lr:embedding:0.2", Axis("lr:embedding", 0.2)),
        ("lr:decoder.*:0.2:1e-6:1e-2", Axis("lr:decoder.*", 0.2, min=1e-6, max=1e-2)),
        ("weight_decay:0.5", Axis("weight_decay", 0.5)),
        ("attention_temperature:0.1", Axis("attention_temperature", 0.1)),
    ],
)
def test_parse_axis_examples(text, expected):
    assert parse_axis(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("lr", "expected NAME:SPREAD"),
        ("lr:0.1:0", "expected NAME:SPREAD"),
        ("dropout:x", "must be numbers"),
        ("lr:embedding:0.1:x:1", "must be numbers"),
        ("lr:embedding:x:y", "expected NAME:SPREAD"),
        ("dropout::0:1", "SPREAD is required"),
        ("foo:0.1", "Axis.name='foo'"),
        ("lr:1.5", r"Axis\('lr'\)\.spread=1\.5"),
        ("dropout:0.1:0.5:0.1", "inverted"),
    ],
)
def test_parse_axis_errors(text, message):
    with pytest.raises(HDETConfigError, match=message):
        parse_axis(text)


def test_axes_from_strings():
    assert axes_from_strings(["lr:0.1", "dropout:0.05:0:0.3"]) == (
        Axis("lr", 0.1),
        Axis("dropout", 0.05, min=0.0, max=0.3),
    )


@pytest.mark.parametrize(
    "config",
    [
        HDETConfig(),
        HDETConfig(
            period=250,
            arms=4,
            grad_sync="arm",
            temperature="auto",
            rule="paper",
            seed=7,
            axes=(Axis("lr:embedding", 0.2, kind="log", min=1e-6), Axis("dropout", 0.05, min=0.0, max=0.3)),
            scale_bounds=(0.1, 10.0),
            nonfinite="raise",
            rollback=True,
            auto_start=1000,
        ),
    ],
)
def test_fingerprint_round_trip(config):
    data = config.fingerprint()
    assert json.loads(json.dumps(data)) == data  # plain data
    assert isinstance(data["axes"], (list, type(None))) and isinstance(data["scale_bounds"], list)
    assert HDETConfig.from_fingerprint(data) == config
    assert HDETConfig.from_fingerprint(json.loads(json.dumps(data))) == config
    with pytest.raises(HDETConfigError, match="period"):
        HDETConfig.from_fingerprint({**data, "period": 0})


def test_replace_revalidates():
    config = HDETConfig()
    assert config.replace(period=10).period == 10
    with pytest.raises(HDETConfigError, match="period"):
        config.replace(period=0)
