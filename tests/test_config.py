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
)


def test_defaults_follow_the_paper():
    config = HDETConfig()
    assert config.period == 1000 and config.arms is None and config.grad_sync == "global"
    assert config.axes == (Axis("lr", 1 / 9),)
    assert config.temperature == 0.1 and config.meta_lr == 0.5 and config.momentum == 0.9
    assert config.rule == "relative" and config.scale_bounds == (0.01, 100.0)
    assert config.nonfinite == "exclude" and not config.rollback
    assert config.axis("lr").spread == 1 / 9 and config.axis("dropout") is None


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
    assert isinstance(data["axes"], list) and isinstance(data["scale_bounds"], list)
    assert HDETConfig.from_fingerprint(data) == config
    assert HDETConfig.from_fingerprint(json.loads(json.dumps(data))) == config
    with pytest.raises(HDETConfigError, match="period"):
        HDETConfig.from_fingerprint({**data, "period": 0})


def test_replace_revalidates():
    config = HDETConfig()
    assert config.replace(period=10).period == 10
    with pytest.raises(HDETConfigError, match="period"):
        config.replace(period=0)
