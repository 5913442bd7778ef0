"""The package's face: ``from hdet_megatron import ...`` works, and importing costs little.

Each check runs in a fresh interpreter (``sys.modules`` of this test process already holds
torch and megatron).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import hdet_megatron

FACE = ["HDETConfig", "Axis", "AutoController", "BucketedAverager", "HDETOneCycleLR"]
MATH = [
    "hdet_megatron.config",
    "hdet_megatron.spread",
    "hdet_megatron.schedule",
    "hdet_megatron.controller",
    "hdet_megatron.sim",
]

PROBE = textwrap.dedent("""
    import json, sys

    def loaded():
        names = set(sys.modules)
        return {"torch": "torch" in names, "torch.distributed": "torch.distributed" in names,
                "megatron": any(n == "megatron" or n.startswith("megatron.") for n in names)}

    out = {}
    import hdet_megatron
    out["import hdet_megatron"] = loaded()
    from hdet_megatron import HDETConfig, Axis, AutoController
    HDETConfig(axes=(Axis("lr", 0.1),)); AutoController(HDETConfig(arms=2), 2)
    out["config and controller"] = loaded()
    for name in MATH:
        __import__(name)
    out["math modules"] = loaded()
    from hdet_megatron import BucketedAverager, HDETOneCycleLR
    out["averager and scheduler"] = loaded()
    from hdet_megatron import *  # noqa: F403
    out["star"] = loaded()
    out["all"] = sorted(hdet_megatron.__all__)
    print(json.dumps(out))
""")


def _probe() -> dict:
    code = f"MATH = {MATH!r}\n" + PROBE
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_cost():
    out = _probe()
    nothing = {"torch": False, "torch.distributed": False, "megatron": False}
    assert out["import hdet_megatron"] == nothing
    assert out["config and controller"] == nothing  # the math is pure Python
    assert out["math modules"] == nothing
    assert out["averager and scheduler"] == {"torch": True, "torch.distributed": True, "megatron": False}
    assert out["star"]["megatron"] is False
    assert set(FACE) <= set(out["all"])


def test_public_names():
    from hdet_megatron import averaging, config, controller, torch_scheduler

    assert set(FACE) <= set(hdet_megatron.__all__)
    assert hdet_megatron.HDETConfig is config.HDETConfig and hdet_megatron.Axis is config.Axis
    assert hdet_megatron.AutoController is controller.AutoController
    assert hdet_megatron.BucketedAverager is averaging.BucketedAverager
    assert hdet_megatron.HDETOneCycleLR is torch_scheduler.HDETOneCycleLR
    for name in hdet_megatron.__all__:
        assert getattr(hdet_megatron, name) is not None, name
    assert set(hdet_megatron.__all__) <= set(dir(hdet_megatron))
    try:
        hdet_megatron.HDET  # noqa: B018 - the Megatron names stay in hdet_megatron.megatron
    except AttributeError as exc:
        assert "HDET" in str(exc)
    else:
        raise AssertionError("hdet_megatron.HDET should not exist")


def test_megatron_names_stay_in_the_subpackage():
    import hdet_megatron.megatron as hm
    from hdet_megatron.megatron.runtime import HDET
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

    assert hm.HDET is HDET and hm.HDETOptimizerParamScheduler is HDETOptimizerParamScheduler
    assert {"HDET", "HDETOptimizerParamScheduler", "ArmLayout", "HDETSetupError"} <= set(hm.__all__)
