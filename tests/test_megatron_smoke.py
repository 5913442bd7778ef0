"""Real Megatron-Core training on gloo CPU ranks: pipeline schedule, TP collectives, DDP buffers."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world

pytestmark = pytest.mark.slow


def params_digest(model) -> str:
    digest = hashlib.sha256()
    for name, param in model[0].module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _smoke(rank, world_size, tp, pp, steps, dist_opt=False):
    from hdet_megatron.megatron import toy

    from megatron.core import parallel_state as ps

    setup = toy.ToyGPTSetup(tp=tp, pp=pp, num_layers=2 * pp, use_distributed_optimizer=dist_opt)
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        data = toy.data_iterator_for_rank(setup)
        losses = []
        start = time.perf_counter()
        for _ in range(steps):
            out, ok = toy.train_step(setup, model, optimizer, data)
            assert ok
            if ps.is_pipeline_last_stage():
                losses.append(float(torch.stack([o["lm loss"] for o in out]).mean()))
            else:
                assert out == [] or all(not o for o in out)
        step_seconds = (time.perf_counter() - start) / steps
        # All DP replicas must hold identical parameters after plain DDP training: gather the
        # digests over the DP group and compare.
        digests = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(digests, params_digest(model), group=ps.get_data_parallel_group())
        return {
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "last_stage": ps.is_pipeline_last_stage(),
            "losses": losses,
            "dp_digests": digests,
            "step_seconds": step_seconds,
        }


def _check(results, steps):
    last = [r for r in results if r["last_stage"]]
    assert last
    for r in last:
        assert len(r["losses"]) == steps
        assert r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]
    # TP ranks of one stage and DP replica see the same loss (bit-identical floats).
    by_replica: dict = {}
    for r in last:
        by_replica.setdefault(r["dp_rank"], []).append(r["losses"])
    for losses in by_replica.values():
        assert all(x == losses[0] for x in losses)
    for r in results:
        assert len(set(r["dp_digests"])) == 1, "DP replicas diverged under plain DDP"


@pytest.mark.parametrize(
    "world,tp,pp,dist_opt",
    [(8, 2, 2, False), (4, 2, 1, False), (4, 1, 2, True)],
    ids=["tp2pp2dp2", "tp2dp2", "pp2dp2-distopt"],
)
def test_megatron_trains(world, tp, pp, dist_opt):
    steps = 6
    results = run_world(world, _smoke, tp, pp, steps, dist_opt)
    _check(results, steps)
    print(f"\n{world} ranks tp{tp} pp{pp}: {results[0]['step_seconds'] * 1e3:.0f} ms/step")
