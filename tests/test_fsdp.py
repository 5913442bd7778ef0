"""HDET on PyTorch FSDP2 (fully_shard) with an HSDP mesh: arms = replicate dim (gloo, 4 and 8 ranks)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.fsdp_worker import FSDPScenario, world_tasks
from tests.harness import run_world

pytestmark = pytest.mark.slow


def check_hdet_run(sc: FSDPScenario, results: list[dict]) -> None:
    """The must-shows for one HDET run (all ranks' records)."""
    num_arms = len({r["arm"] for r in results})
    period = sc.period
    # 0. FSDP2's padded local shards live in the converge buckets; every converge matched the
    #    copying path bit for bit.
    for r in results:
        assert r["homed_numel"] == r["averaged_numel"] > 0
        assert r.get("homing_checks", 0) == len(r["history"])
    steps = sorted(results[0]["lrs"])
    # 1. Every rank of one arm (all its shard ranks and replicas) uses the same LR; arms differ.
    for step in steps:
        by_arm: dict = {}
        for r in results:
            by_arm.setdefault(r["arm"], set()).add(r["lrs"][step])
        assert all(len(v) == 1 for v in by_arm.values()), (step, by_arm)
        if sc.spread > 0:
            assert len({next(iter(v)) for v in by_arm.values()}) == num_arms, (step, by_arm)
    # 2. After each converge the gathered parameters of all arms are bit-identical...
    converged = [s for s in steps if s % period == 0]
    for s in converged:
        assert len({r["digests"][s] for r in results}) == 1, f"arms differ after the converge at {s}"
        assert len({r["full_digests"][s] for r in results}) == 1, s
    # ...the ranks of one arm always agree, and the arms diverge inside windows.
    diverged = False
    for s in steps:
        by_arm = {}
        for r in results:
            by_arm.setdefault(r["arm"], set()).add(r["digests"][s])
        assert all(len(v) == 1 for v in by_arm.values()), (s, by_arm)
        if s not in converged and len({next(iter(v)) for v in by_arm.values()}) > 1:
            diverged = True
    if sc.spread > 0 and num_arms > 1:
        assert diverged, "arms never diverged inside a window"
    # 3. Every rank made the same controller update from the arms' own mean losses.
    for r in results[1:]:
        assert r["history"] == results[0]["history"]
    for entry in results[0]["history"]:
        window = range(entry["first"], entry["step"] + 1)
        for arm in range(num_arms):
            local = [sum(r["losses"][s] for s in window) / len(window) for r in results if r["arm"] == arm]
            assert math.isclose(entry["arm_losses"][arm], sum(local) / len(local), rel_tol=1e-6)


def check_same_trajectory(a: list[dict], b: list[dict], steps) -> None:
    for s in steps:
        assert [r["digests"][s] for r in a] == [r["digests"][s] for r in b], f"step {s}"
        assert [r["lrs"][s] for r in a] == [r["lrs"][s] for r in b], f"lr at step {s}"


def test_fsdp_2_arms_x_2_shards_and_resume(tmp_path):
    plain = FSDPScenario(hdet=False)
    neutral = FSDPScenario(spread=0.0, auto=False)
    # Saves at step 4 (mid-window) WITHOUT converge: the run itself is the uninterrupted one.
    spread = FSDPScenario(save_at=4, save_dir=str(tmp_path / "global"), save_converge=False)
    # Arm-local gradients; saves at step 5 with converge-on-save (the default).
    arm = FSDPScenario(grad_sync="arm", save_at=5, save_dir=str(tmp_path / "arm"))
    scenarios = [plain, neutral, spread, arm]
    example = ["--steps", "6", "--period", "3", "--save-at", "0"]  # the README's example
    per_rank = run_world(
        4,
        world_tasks,
        scenarios,
        grad_checks=[(2, "global"), (2, "arm")],
        errors=True,
        example=example,
        timeout=300,
    )
    runs = [[per_rank[r]["runs"][i] for r in range(4)] for i in range(len(scenarios))]
    plain_r, neutral_r, spread_r, arm_r = runs

    # Spread 0 and auto off: bit-identical to plain HSDP training at every step.
    check_same_trajectory(plain_r, neutral_r, range(1, plain.steps + 1))
    for sc, res in ((spread, spread_r), (arm, arm_r)):
        check_hdet_run(sc, res)

    # Gradient traffic across arms during fan-out: FSDP2's replicate all-reduce in "global"
    # mode, none at all in "arm" mode (the converge is the only cross-arm traffic).
    for r in spread_r:
        assert all(v > 0 for v in r["grad_bytes"].values())
    for r in arm_r:
        assert all(v == 0 for v in r["grad_bytes"].values()), r["grad_bytes"]
        assert all(c == 0 for c in r["grad_calls"].values())
        assert r["converge_bytes"] and all(b > 0 for b in r["converge_bytes"])
    # The gradients FSDP2 writes: world mean ("global"), the arm's own mean ("arm").
    for r in range(4):
        assert all(d < 1e-6 for d in per_rank[r]["grad_checks"]), per_rank[r]["grad_checks"]

    # A pure-FSDP mesh (or a model sharded over one) is refused with the HSDP explanation.
    errors = per_rank[0]["errors"]
    for key in ("explicit_mesh", "inferred_mesh", "mismatch"):
        assert errors[key] and "hybrid sharding (HSDP)" in errors[key], errors
    assert errors["bad_arms"] and "must divide the replicate size" in errors["bad_arms"]

    # The README example ran (prints one line per arm and step on shard rank 0).
    assert len(per_rank[0]["example"]) == 6 and "converged" in per_rank[0]["example"][2]

    # Resume both checkpoints in new processes and continue.
    resumed = run_world(
        4,
        world_tasks,
        [
            dataclasses.replace(spread, save_at=None, resume_from=spread.save_dir),
            dataclasses.replace(arm, save_at=None, resume_from=arm.save_dir),
        ],
        timeout=300,
    )
    res_spread = [resumed[r]["runs"][0] for r in range(4)]
    res_arm = [resumed[r]["runs"][1] for r in range(4)]
    # Without converge: the arms' own parameters were saved; equal to the uninterrupted run.
    assert res_spread[0]["layout"]["per_arm_params"] and res_spread[0]["start"] == 4
    check_same_trajectory(spread_r, res_spread, range(5, spread.steps + 1))
    # Converge-on-save (arm-local moments saved per arm): equal to the saving run's continuation.
    assert res_arm[0]["layout"]["converged"] and res_arm[0]["layout"]["per_arm_optim"]
    assert len({r["digest_after_save"] for r in arm_r}) == 1  # one averaged model was saved
    check_same_trajectory(arm_r, res_arm, range(6, arm.steps + 1))
    for a, b in zip(arm_r, res_arm, strict=True):
        assert [h for h in a["history"] if h["step"] > 5] == b["history"]


def test_fsdp_4_arms_x_2_shards():
    scenarios = [
        FSDPScenario(replicas=4, hdet=False, steps=4),
        FSDPScenario(replicas=4, spread=0.0, auto=False, steps=4),
        FSDPScenario(replicas=4),
        FSDPScenario(replicas=4, grad_sync="arm"),
        # 2 arms of 2 replicas each: gradients are all-reduced inside the arm only.
        FSDPScenario(replicas=4, arms=2, grad_sync="arm"),
    ]
    per_rank = run_world(8, world_tasks, scenarios, grad_checks=[(4, "arm")], timeout=400)
    runs = [[per_rank[r]["runs"][i] for r in range(8)] for i in range(len(scenarios))]
    check_same_trajectory(runs[0], runs[1], range(1, scenarios[0].steps + 1))
    for sc, res in zip(scenarios[2:], runs[2:], strict=True):
        check_hdet_run(sc, res)
    assert len({r["arm"] for r in runs[2]}) == 4
    assert len({r["arm"] for r in runs[4]}) == 2
    for r in runs[2]:
        assert all(v > 0 for v in r["grad_bytes"].values())
    for r in runs[3] + runs[4]:
        assert all(v == 0 for v in r["grad_bytes"].values()), r["grad_bytes"]
    for r in range(8):
        assert all(d < 1e-6 for d in per_rank[r]["grad_checks"])
