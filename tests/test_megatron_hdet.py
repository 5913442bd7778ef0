"""HDET on real Megatron-Core worlds: arms over DP, per-arm LR, converge, TP/PP in sync."""

from __future__ import annotations

import math

import pytest

from tests.harness import run_world
from tests.megatron_hdet_worker import Scenario, bad_setups, run

pytestmark = pytest.mark.slow


def run_many(rank, world_size, scenarios):
    return [run(rank, world_size, sc) for sc in scenarios]


def _worlds(world_size, scenarios, timeout=400):
    per_rank = run_world(world_size, run_many, scenarios, timeout=timeout)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(scenarios))]


def check_hdet_run(sc: Scenario, results: list[dict]) -> None:
    num_arms = len({r["arm"] for r in results})
    period = sc.period
    # 0. Main params live in the converge buckets (homed), except DistOpt's fp32 shards (views
    #    of DDP's param buffer: copying path); every converge matched the copying path bit for bit.
    for r in results:
        want = 0 if sc.dist_opt and not sc.bf16 else r["averaged_numel"]
        assert r["homed_numel"] == want and r["averaged_numel"] > 0, (sc, r["homed_numel"])
        assert r["homing_checks"] == len(r["history"]) > 0
        # Converge traffic next to the DP gradient sync's (Megatron DDP's grad buffers).
        for h in r["history"]:
            assert h["grad_bytes"] > 0 and h["bytes_per_step"] == h["bytes"] / period
    steps, period = sc.steps, sc.period
    # 1. Every rank of one arm (all TP/PP ranks, all replicas of the arm) applies the same LR.
    for step in range(steps):
        by_arm: dict = {}
        for r in results:
            by_arm.setdefault(r["arm"], set()).add(r["lrs"][step])
        assert all(len(v) == 1 for v in by_arm.values()), (step, by_arm)
        values = {next(iter(v)) for v in by_arm.values()}
        if sc.spread > 0 and next(iter(values)) > 0:
            assert len(values) == num_arms, f"arms share an LR at step {step}: {by_arm}"
    # 2. Converge points: cross-arm ranks hold bit-identical main and model params.
    converged_steps = [s for s in range(steps) if (s + 1) % period == 0]
    diverged_somewhere = False
    for r_idx, r in enumerate(results):
        for other in r["cross"]:
            for s in converged_steps:
                assert results[other]["step_digests"][s] == r["step_digests"][s], (r_idx, other, s)
            inside = [s for s in range(1, steps) if s not in converged_steps]
            if other != r_idx and any(
                results[other]["step_digests"][s]["main"] != r["step_digests"][s]["main"] for s in inside
            ):
                diverged_somewhere = True
    if sc.spread > 0 and num_arms > 1:
        assert diverged_somewhere, "arms never diverged inside a window"
    # 3. The controller update is the same on every rank of the world...
    assert len(results[0]["history"]) == len(converged_steps)

    def controller_view(r):  # converge bytes differ per shard; the controller must not
        return [{k: v for k, v in h.items() if "bytes" not in k} for h in r["history"]]

    for r in results[1:]:
        assert controller_view(r) == controller_view(results[0])
    # ...and used the losses each arm computed locally (mean over the arm's replicas).
    # With signal="probe" the controller used each arm's probe loss (arm_losses) and the window
    # training losses are still reported (arm_train_losses).
    for w, s_end in enumerate(converged_steps):
        window = range(s_end - period + 1, s_end + 1)
        for arm in range(num_arms):
            reporters = [r for r in results if r["reporter"] and r["arm"] == arm]
            local = [sum(r["losses"][s] for s in window) / period for r in reporters]
            expected = sum(local) / len(local)
            history = results[0]["history"][w]
            got = history["arm_train_losses"][arm]
            assert math.isclose(got, expected, rel_tol=1e-6), (w, arm, got, expected)
            if sc.probe:
                probed = sum(r["probe_losses"][w] for r in reporters) / len(reporters)
                assert math.isclose(history["arm_losses"][arm], probed, rel_tol=1e-6), (w, arm)
                assert history["arm_losses"][arm] != got
            else:
                assert history["arm_losses"][arm] == got
    for r in results:  # the probe ran once per window on every rank (a collective), else never
        assert len(r["probe_losses"]) == (len(converged_steps) if sc.probe and sc.auto else 0)


def test_tp2_pp2_dp2_both_modes():
    scenarios = [
        Scenario(tp=2, pp=2, grad_sync="global", count_bytes=True),
        Scenario(tp=2, pp=2, grad_sync="arm", count_bytes=True),
        Scenario(tp=2, pp=2, grad_sync="global", probe=True),
    ]
    worlds = _worlds(8, scenarios)
    for sc, results in zip(scenarios, worlds, strict=True):
        check_hdet_run(sc, results)
    # The counter sees gradient traffic between arms in "global" mode (the paper's setting)...
    for r in worlds[0]:
        assert all(b > 2 * r["averaged_bytes"] for b in r["window_bytes"])
    # grad_sync="arm": the only traffic between arms is one parameter all-reduce per window
    # (plus the float64 loss/health reduction every rank takes part in: A health flags and one
    # 7-entry row per DP replica, hdet_megatron.window_losses).
    arm_results = worlds[1]
    for r in arm_results:
        loss_bytes = (2 + 2 * 7) * 8
        assert r["window_bytes"] == [r["averaged_bytes"] + loss_bytes] * len(r["history"])


def test_tp2_dp4_arms_4_and_2():
    scenarios = [
        Scenario(tp=2, arms=4, grad_sync="global"),
        Scenario(tp=2, arms=2, grad_sync="global"),
        Scenario(tp=2, arms=2, grad_sync="arm", count_bytes=True),
    ]
    worlds = _worlds(8, scenarios)
    for sc, results in zip(scenarios, worlds, strict=True):
        check_hdet_run(sc, results)
    # Hierarchical arms (2 replicas per arm): the replicas of one arm stay identical always.
    for results in worlds[1:]:
        for s in range(scenarios[1].steps):
            for r in results:
                twins = [o for o in results if o["arm"] == r["arm"] and o["tp_rank"] == r["tp_rank"]]
                assert len({t["step_digests"][s]["main"] for t in twins}) == 1
    for r in worlds[2]:
        assert r["window_bytes"] == [r["averaged_bytes"] + (2 + 4 * 7) * 8] * len(r["history"])


def test_pp2_dp4_distributed_optimizer_instances():
    scenarios = [
        Scenario(pp=2, arms=2, dist_opt=True, grad_sync="global"),
        Scenario(pp=2, arms=4, dist_opt=True, grad_sync="arm", count_bytes=True),
        Scenario(pp=2, arms=2, dist_opt=True, bf16=True, grad_sync="global"),
    ]
    worlds = _worlds(8, scenarios)
    for sc, results in zip(scenarios, worlds, strict=True):
        check_hdet_run(sc, results)
    for r in worlds[1]:
        assert r["window_bytes"] == [r["averaged_bytes"] + (4 + 4 * 7) * 8] * len(r["history"])


def test_neutral_hdet_is_bit_identical_and_bf16_masters():
    scenarios = [
        Scenario(tp=2, spread=0.0, auto=False, hdet=True, period=2, steps=6),
        Scenario(tp=2, hdet=False, steps=6),
        Scenario(tp=2, bf16=True, steps=6),
        Scenario(tp=2, steps=6, data_seed=3),
        Scenario(tp=2, steps=6, data_seed=3),
        Scenario(tp=2, spread=0.0, hdet=True, period=2, steps=6, probe=True),
        Scenario(tp=2, spread=0.0, auto=False, hdet=True, period=2, steps=6, probe=True),
    ]
    neutral, plain, bf16, first, second, neutral_probe, probe_off = _worlds(4, scenarios)
    # signal="probe" with identical arms: the probe batch is the same on every arm, so the arms'
    # probe losses are bit-identical (their training losses are not: different data), the
    # controller has nothing to move, and the probe's forward pass leaves training untouched.
    for r, n in zip(neutral_probe, neutral, strict=True):
        assert r["final_model"] == n["final_model"] and r["losses"] == n["losses"]
        assert len(r["probe_losses"]) == 3
        for h in r["history"]:
            assert len(set(h["arm_losses"])) == 1 and len(set(h["arm_train_losses"])) == 2
            assert h["scales"]["lr"] == 1.0
    # With auto-LR off nothing reads the probe: it never runs, the arms' training losses are
    # what the (idle) controller saw, and training is the same.
    for r, n in zip(probe_off, neutral, strict=True):
        assert r["probe_losses"] == [] and r["final_model"] == n["final_model"]
        for h in r["history"]:
            assert h["arm_losses"] == h["arm_train_losses"]
    # Determinism: two identical HDET runs give bit-identical losses, params and controller.
    for a, b in zip(first, second, strict=True):
        assert a["losses"] == b["losses"] and a["history"] == b["history"]
        assert a["final_model"] == b["final_model"]
        assert a["history"][0]["scales"]["lr"] != 1.0  # the controller really moved
    for a, b in zip(neutral, plain, strict=True):
        assert a["losses"] == b["losses"]
        assert a["final_model"] == b["final_model"]
        assert [d["model"] for d in a["step_digests"]] == [d["model"] for d in b["step_digests"]]
    check_hdet_run(scenarios[2], bf16)


def test_bad_setups_get_clear_errors():
    messages = run_world(4, bad_setups, timeout=200)
    for m in messages:
        assert "must divide the data-parallel size 2" in m["arms_not_dividing_dp"]
        assert "needs an HDETOptimizerParamScheduler" in m["plain_scheduler"]
        assert "num_distributed_optimizer_instances=2" in m["distopt_instances"]
        assert "param groups changed" in m["param_groups_changed"]
        assert "initialize_model_parallel" in m["parallel_state_not_initialized"]
        assert "no loss key" in m["loss_key_missing"] and "loss_keys=" in m["loss_key_missing"]
        assert "needs Megatron DistributedDataParallel" in m["arm_sync_without_megatron_ddp"]
        assert "signal='probe' needs a probe" in m["probe_without_probe_fn"]
        assert "use_precision_aware_optimizer" in m["precision_aware_optimizer"]
        assert "train without it, or with --no-hdet" in m["precision_aware_optimizer"]
    last_stage = [m for m in messages]  # PP=1: every rank is on the last stage
    for m in last_stage:
        assert "got no losses on the last pipeline stage" in m["no_losses_on_last_stage"]
