"""HDET with Megatron-Core's --use-torch-fsdp2 wrapping (TorchFullyShardedDataParallel), sharded
inside each arm (HSDP): 2 arms x 2 shards on 4 gloo ranks. Megatron-FSDP's CPU failure is recorded."""

from __future__ import annotations

import math

import pytest

from tests.harness import run_world
from tests.megatron_fsdp_worker import MegatronFSDPScenario as Sc
from tests.megatron_fsdp_worker import world_tasks

pytestmark = pytest.mark.slow


def test_torch_fsdp2_hsdp_arms():
    scenarios = [
        Sc(hdet=False),  # plain HSDP: wrap_torch_fsdp2 + cross-arm all-reduce hook, no HDET
        Sc(spread=0.0, auto=False),
        Sc(),
        Sc(grad_sync="arm"),
        Sc(wrap="fsdp", hdet=False),  # Megatron's default: pure FSDP over all 4 DP ranks
    ]
    per_rank = run_world(4, world_tasks, scenarios, with_refusals=True, timeout=500)
    plain, neutral, spread, arm, pure = ([per_rank[r]["runs"][i] for r in range(4)] for i in range(5))
    steps = range(1, scenarios[0].steps + 1)

    # Spread 0, auto off: bit-identical to plain HSDP.
    for s in steps:
        assert [r["digests"][s] for r in plain] == [r["digests"][s] for r in neutral]
    # HSDP computes the same training as Megatron's pure FSDP (not bitwise: other reduction order).
    for a, b in zip(plain, pure, strict=True):
        for s in steps:
            assert math.isclose(a["losses"][s], b["losses"][s], rel_tol=1e-5)

    for sc, res in ((scenarios[2], spread), (scenarios[3], arm)):
        assert sorted(r["arm"] for r in res) == [0, 0, 1, 1]
        for s in steps:
            by_arm: dict = {}
            for r in res:
                by_arm.setdefault(r["arm"], set()).add((r["lrs"][s], r["digests"][s]))
            assert all(len(v) == 1 for v in by_arm.values()), (s, by_arm)  # one arm, one LR/model
            lrs = {next(iter(v))[0] for v in by_arm.values()}
            digests = {next(iter(v))[1] for v in by_arm.values()}
            if s % sc.period == 0:
                assert len(digests) == 1, f"arms differ after the converge at step {s}"
            elif s > 1:
                assert len(digests) == 2, f"arms did not diverge at step {s}"
            if s > 1:  # step 1 has lr 0 (warm-up)
                assert len(lrs) == 2
        assert [h["step"] for h in res[0]["history"]] == [2, 4]
        for r in res[1:]:
            assert [h["arm_losses"] for h in r["history"]] == [h["arm_losses"] for h in res[0]["history"]]

    # Cross-arm gradient traffic: the HSDP all-reduce hook in "global" mode, nothing in "arm".
    assert all(v > 0 for r in spread for v in r["grad_bytes"].values())
    assert all(v == 0 for r in arm for v in r["grad_bytes"].values())
    assert all(h["bytes"] > 0 for h in arm[0]["history"])

    refusals = per_rank[0]["refusals"]
    assert refusals["pure_fsdp"].startswith("HSDPRequired") and "wrap_torch_fsdp2" in refusals["pure_fsdp"]
    # Megatron-FSDP: CUDA-only constructor (recorded in hdet_megatron/megatron/fsdp.py).
    assert "Torch not compiled with CUDA enabled" in refusals["megatron_fsdp"]
    assert "torch.cuda.current_device()" in refusals["megatron_fsdp"]
