"""``HDETOptimizerParamScheduler`` is a drop-in for Megatron's ``OptimizerParamScheduler``.

With ``hdet=None``, and with a one-arm neutral HDET config, every value it sets and every state
it saves or loads equals Megatron's, step by step, with and without torch.distributed (the
cases, modelled on Megatron-LM's scheduler unit tests, are in ``tests/drop_in_cases.py``).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests import drop_in_cases as cases
from tests.harness import run_world


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.__name__[len("case_") :])
@pytest.mark.parametrize("mode", list(cases.MODES))
def test_same_as_megatron_without_torch_distributed(mode, case):
    assert not dist.is_initialized()
    case(cases.MODES[mode])


def test_same_as_megatron_on_a_process_group():
    results = run_world(2, cases.world_cases, timeout=240)
    for rank, result in enumerate(results):
        failed = {k: v for k, v in result.items() if v != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}:\n{v}" for k, v in failed.items())
        assert len(result) == len(cases.MODES) * len(cases.CASES)


def test_plain_scheduler_has_no_hdet_parts():
    from hdet_megatron.megatron.layout import HDETSetupError

    ref, _, ours, _ = cases.pair(None)
    assert ours.hdet_config is None and not ours.hdet_enabled and ours.controller is None
    assert "hdet" not in ours.state_dict() and ours.arm_factor("lr") == 1.0
    assert ours.arm_spread_values() == {} and ours.base_values() == {}
    with pytest.raises(HDETSetupError, match="hdet=None"):
        ours.set_window(1)
    with pytest.raises(HDETSetupError, match="hdet must be an HDETConfig or None"):
        cases.HDETOptimizerParamScheduler(cases._optimizer([{"lr": 0.0}]), hdet={"period": 3}, **cases.BASE)


def test_plain_scheduler_ignores_an_hdet_checkpoint():
    """An HDET run's scheduler state loads into hdet=None as into Megatron's (key ignored)."""
    _, _, hdet_sched, _ = cases.pair(cases.NEUTRAL)
    hdet_sched.step(250)
    state = hdet_sched.state_dict()
    assert "hdet" in state
    ref, ref_opt, ours, opt = cases.pair(None)
    ref.load_state_dict(dict(state))
    ours.load_state_dict(dict(state))
    assert cases._snapshot(ours, opt) == cases._snapshot(ref, ref_opt)
    assert ours.num_steps == 250
