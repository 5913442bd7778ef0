"""The bad-input catalogue (docs/troubleshooting.md): each error names the problem and a fix.

Config and flag errors are checked here; process-group, optimizer and runtime errors need a real
Megatron world and are checked in ``tests/test_megatron_hdet.py::test_bad_setups_get_clear_errors``
and ``tests/test_megatron_axes.py``; checkpoint contents in the checkpoint tests.
"""

from __future__ import annotations

import argparse

import pytest

from hdet_megatron.args import add_hdet_args, hdet_config_from_args
from hdet_megatron.config import Axis, HDETConfig, HDETConfigError


def _flags(*argv):
    parser = argparse.ArgumentParser()
    add_hdet_args(parser)
    return hdet_config_from_args(parser.parse_args(list(argv)))


CATALOGUE = [
    # (id, how to trigger, the problem named, the suggestion given)
    ("spread_ge_1", lambda: HDETConfig(axes=(Axis("lr", 1.2),)), "multiplier <= 0", "use spread < 1"),
    ("period_lt_1", lambda: HDETConfig(period=0), "HDETConfig.period=0", "integer >= 1"),
    ("arms_lt_1", lambda: HDETConfig(arms=0), "HDETConfig.arms=0", "or None"),
    ("sigma_le_0", lambda: HDETConfig(temperature=0.0), "HDETConfig.temperature=0.0", "or 'auto'"),
    (
        "bounds_inverted",
        lambda: HDETConfig(scale_bounds=(2.0, 0.5)),
        "scale_bounds",
        "0 < c_min <= 1 <= c_max",
    ),
    ("unknown_axis", lambda: HDETConfig(axes=(Axis("momentum", 0.1),)), "not a known axis", "use one of"),
    (
        "axis_twice",
        lambda: HDETConfig(axes=(Axis("lr", 0.1), Axis("lr", 0.2))),
        "twice",
        "give each axis once",
    ),
    (
        "lr_and_group_lr",
        lambda: HDETConfig(axes=(Axis("lr", 0.1), Axis("lr:no_wd", 0.2))),
        "overlap",
        "use either",
    ),
    ("bad_grad_sync", lambda: HDETConfig(grad_sync="local"), "grad_sync='local'", "'global' or 'arm'"),
    ("bad_nonfinite", lambda: HDETConfig(nonfinite="ignore"), "nonfinite='ignore'", "'exclude' or 'raise'"),
    ("dropout_bounds", lambda: HDETConfig(axes=(Axis("dropout", 0.1, max=1.0),)), "leave [0, 1)", "< 1"),
    (
        "temperature_le_0",
        lambda: HDETConfig(axes=(Axis("attention_temperature", 0.1, min=0.0),)),
        "temperature <= 0",
        "use min > 0",
    ),
    (
        "flag_conflict",
        lambda: _flags("--hdet-spread", "0.2", "--hdet-axis", "lr:0.1"),
        "conflict",
        "inside --hdet-axis",
    ),
    ("axis_syntax", lambda: _flags("--hdet-axis", "lr"), "expected NAME:SPREAD", "e.g. lr:0.111"),
    ("bucket_mb", lambda: HDETConfig(bucket_mb=0), "HDETConfig.bucket_mb=0", "must be > 0"),
]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_catalogue_error_names_problem_and_fix(case):
    _id, trigger, problem, suggestion = case
    with pytest.raises(HDETConfigError) as info:
        trigger()
    message = str(info.value)
    assert problem in message, message
    assert suggestion in message, message
