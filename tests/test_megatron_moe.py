"""HDET on mixture-of-experts (expert parallel) and context-parallel Megatron meshes."""

from __future__ import annotations

import pytest
import torch

from hdet_megatron.megatron import mesh
from tests.checkpoint_worker import Run, resume, train_and_save
from tests.cp_worker import AllGatherCPAttention, cp_cases, cp_layouts
from tests.harness import run_world
from tests.moe_worker import layout_cases, moe_cases
from tests.test_checkpointing import FORMATS, _same_run


def test_valid_arm_counts_keep_expert_groups_whole():
    # TP1 DP4 EP2 (megatron-core 0.19.2): EP groups (0,1),(2,3), expert-DP (0,2),(1,3).
    dp4 = {r: (0, 1, 2, 3) for r in range(4)}
    assert mesh.valid_arm_counts(dp4, [(0, 1), (2, 3)]) == [1, 2]
    assert mesh.valid_arm_counts(dp4, [(0, 1, 2, 3)]) == [1]
    assert mesh.valid_arm_counts(dp4, []) == [1, 2, 4]
    # DP8 EP2: any arm of 2, 4 or 8 replicas... and arms of one replica split EP groups.
    dp8 = {r: tuple(range(8)) for r in range(8)}
    assert mesh.valid_arm_counts(dp8, [(0, 1), (2, 3), (4, 5), (6, 7)]) == [1, 2, 4]
    arms = mesh.arm_map(dp8, 2)
    assert mesh.split_groups(arms, [(3, 4), (0, 1)]) == [(3, 4)]
    # TP2 DP2 (DP groups (0,2),(1,3)) with EP2 and expert TP1: EP groups are TP peers (0,1),(2,3).
    tp2 = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    assert mesh.valid_arm_counts(tp2, [(0, 1), (2, 3)]) == [1, 2]
    assert mesh.valid_arm_counts(tp2, [(0, 2), (1, 3)]) == [1]
    # Cross-arm subsets: the same position inside each arm; unequal arms are refused.
    arms = mesh.arm_map(dp8, 2)
    assert mesh.cross_arm_subset(arms, (0, 2, 4, 6), 2) == (2, 6)
    assert mesh.arm_subset(arms, (0, 2, 4, 6), 1) == (4, 6)
    with pytest.raises(ValueError, match="unequal"):
        mesh.cross_arm_subset(arms, (0, 2, 4), 0)


@pytest.mark.slow
def test_expert_parallel_layouts_are_refused_or_chosen_before_the_first_step():
    results = run_world(4, layout_cases, timeout=200)
    for rank, out in enumerate(results):
        # DP4 EP2: EP groups (0,1),(2,3). Default arms: 2 (never 4, which splits EP groups).
        assert out[("dp4_ep2", "ep_ranks")] == ((0, 1) if rank < 2 else (2, 3))
        assert out[("dp4_ep2", None)]["arms"] == 2
        assert out[("dp4_ep2", None)]["cross"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert out[("dp4_ep2", 2)]["arms"] == 2 and out[("dp4_ep2", 1)]["arms"] == 1
        err = out[("dp4_ep2", 4)]
        assert err.startswith("error: HDET arms=4 splits expert-parallel groups"), err
        assert "(0, 1)" in err and "use arms in [1, 2]" in err
        assert out[("dp4_ep2", "scheduler")] == err
        # TP2 x EP2 with expert TP 1: the EP group is the TP pair, arms=2 holds it whole.
        assert out[("tp2_ep2_etp1", None)]["arms"] == 2
        assert out[("tp2_ep2_etp1", 4)].startswith("error: HDET arms=4 must divide the data-parallel size 2")
        # Expert TP 2 x EP 2 spans both DP replicas: only one arm, so the default refuses.
        for name in ("tp2_ep2_etp2", "dp4_ep4"):
            err = out[(name, None)]
            assert err.startswith("error: HDET cannot place arms on this mesh"), err
            assert out[(name, 1)]["arms"] == 1
            assert "use arms in [1]" in out[(name, 2)]


def _check_converges(name: str, results: list[dict], holders: dict[int, tuple[int, ...]]) -> int:
    """After every converge: dense params identical on all ranks, each expert identical on the
    ranks holding it, different experts never equal; mid-window the arms differ. Returns the
    number of converges checked."""
    runs = [r[name] for r in results]
    arm = [run["arm"] for run in runs]
    tp = [run["tp_rank"] for run in runs]
    converges = 0
    for step, entries in enumerate(zip(*(run["steps"] for run in runs), strict=True)):
        # Expert param groups follow their arm's LR: every group of a rank has one LR.
        for entry in entries:
            assert any(e for e, _ in entry["lrs"]) and len({lr for _, lr in entry["lrs"]}) == 1, entry["lrs"]
        lr_of_arm = {a: e["lrs"][0][1] for a, e in zip(arm, entries, strict=True)}
        assert len(set(lr_of_arm.values())) == len(lr_of_arm), (name, step, lr_of_arm)
        experts = {}
        for rank, entry in enumerate(entries):
            for e, d in entry["experts"].items():
                experts.setdefault(e, {})[rank] = d
        assert {e: tuple(sorted(v)) for e, v in experts.items()} == holders
        if entries[0]["converged"]:
            converges += 1
            for t in set(tp):  # dense params (each TP shard) identical on every replica
                assert len({e["dense"] for e, r in zip(entries, tp, strict=True) if r == t}) == 1, (
                    name,
                    step,
                )
            for e, by_rank in experts.items():
                assert len(set(by_rank.values())) == 1, (name, step, e, by_rank)
            distinct = {next(iter(v.values())) for v in experts.values()}
            assert len(distinct) == len(experts), (name, step, "different experts are equal")
        else:
            # Mid-window: arms differ, in dense params and in each expert's copies.
            for t in set(tp):
                dense = {e["dense"] for e, r in zip(entries, tp, strict=True) if r == t}
                assert len(dense) == len(set(arm)), (name, step)
            for e, by_rank in experts.items():
                assert len(set(by_rank.values())) == len({arm[r] for r in by_rank}), (name, step, e)
    return converges


@pytest.mark.slow
def test_expert_parallel_global_mode_averages_each_expert_only_with_its_copies():
    cases = {
        "alltoall_default_arms": dict(moe_token_dispatcher_type="alltoall"),
        "allgather_arms2": dict(moe_token_dispatcher_type="allgather", arms=2),
    }
    results = run_world(4, moe_cases, cases, timeout=400)
    # DP4 EP2: ranks 0/2 hold experts 0,1 and ranks 1/3 experts 2,3 (expert-DP (0,2),(1,3)).
    holders = {0: (0, 2), 1: (0, 2), 2: (1, 3), 3: (1, 3)}
    for name in cases:
        for rank, out in enumerate(results):
            run = out[name]
            assert run["arms"] == 2 and run["arm"] == rank // 2
            assert run["cross"] == run["expert_cross"] == ((0, 2) if rank % 2 == 0 else (1, 3))
            assert run["expert_main_params"] > 0 and run["averager_parts"] == [2, 2]
        assert _check_converges(name, results, holders) == 2


def _assert_close(a: dict, b: dict, what: str) -> None:
    import torch

    pairs = list(zip(a["dense"], b["dense"], strict=True))
    pairs += [(x, y) for e in a["experts"] for x, y in zip(a["experts"][e], b["experts"][e], strict=True)]
    for x, y in pairs:
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=what)


@pytest.mark.slow
def test_expert_parallel_arm_mode_distributed_optimizer_and_tp2_ep2():
    sgd = dict(optimizer="sgd", clip_grad=0.0, weight_decay=0.0)
    cases = {
        # grad_sync="arm": expert grads reduced over expert-DP inside the arm only.
        "arm": dict(arms=2, grad_sync="arm", count_bytes=True),
        # Megatron's scaling inside the arm: with both arms on the same data and no spread, arm
        # mode takes the same SGD steps as global mode (a wrong 1/DP expert scale would halve them).
        "same_global": dict(
            arms=2, spread=0.0, arm_data=True, optimizer=sgd, steps=3, period=5, return_params=True
        ),
        "same_arm": dict(
            arms=2,
            grad_sync="arm",
            spread=0.0,
            arm_data=True,
            optimizer=sgd,
            steps=3,
            period=5,
            return_params=True,
        ),
        # The partial distributed optimizer (one instance per arm), bf16, both modes.
        "distopt_global": dict(arms=2, use_distributed_optimizer=True, bf16=True, count_bytes=True),
        "distopt_arm": dict(
            arms=2, use_distributed_optimizer=True, bf16=True, grad_sync="arm", count_bytes=True
        ),
        # TP2 x EP2 (expert TP 1: the EP group is the TP pair) with sequence parallelism.
        "tp2_ep2_sp": dict(tp=2, etp=1, sequence_parallel=True, arms=2, count_bytes=True),
        "tp2_ep2_sp_arm": dict(
            tp=2, etp=1, sequence_parallel=True, arms=2, grad_sync="arm", count_bytes=True
        ),
    }
    results = run_world(4, moe_cases, cases, timeout=600)
    holders = {0: (0, 2), 1: (0, 2), 2: (1, 3), 3: (1, 3)}
    for name in ("arm", "distopt_global", "distopt_arm", "tp2_ep2_sp", "tp2_ep2_sp_arm"):
        assert _check_converges(name, results, holders) == 2, name
    for rank, out in enumerate(results):
        # Inside the arm: 1/(replicas per arm) (DP4: 2, TP2 x DP2: 1); global mode: 1/DP.
        for name, scale in (("arm", 0.5), ("distopt_arm", 0.5), ("tp2_ep2_sp_arm", 1.0)):
            assert out[name]["grad_cross_bytes"] == 0, (name, rank)
            assert out[name]["expert_scaling"] == [scale], (name, out[name]["expert_scaling"])
        assert out["tp2_ep2_sp"]["expert_scaling"] == [0.5]
        # The counter sees global mode's gradient sync across arms.
        assert out["distopt_global"]["grad_cross_bytes"] > 0 and out["tp2_ep2_sp"]["grad_cross_bytes"] > 0
        assert out["same_global"]["expert_scaling"] == [0.25]
        assert out["tp2_ep2_sp"]["arm"] == rank // 2 and out["tp2_ep2_sp"]["expert_arm"] == (rank,)
        _assert_close(out["same_arm"]["params"], out["same_global"]["params"], f"rank {rank}")
    # The check can fail: arm mode on different data is not global mode.
    assert results[0]["arm"]["steps"][0]["dense"] != results[0]["same_global"]["steps"][0]["dense"]


@pytest.mark.slow
def test_expert_and_context_parallel_checkpoint_resume_is_bit_exact(tmp_path):
    """DP4 EP2 (4 experts, 2 arms, T=2), plain and with the partial distributed optimizer, and
    CP2 x DP2: save mid-window at iteration 3 (the save converges) in both formats; a new world
    resumes each and trains to 6, bit-identical to the uninterrupted run (every rank: its own
    experts)."""
    moe = dict(num_experts=4, ep=2)
    runs = [
        ("moe", Run(arms=2, period=2, steps=6, setup=moe)),
        ("moe_distopt", Run(arms=2, period=2, steps=6, dist_opt=True, setup=moe)),
        # CP2 x DP2 with the test-only CP attention (tests/cp_worker.py).
        ("cp", Run(arms=2, period=2, steps=6, setup=dict(cp=2, core_attention=AllGatherCPAttention))),
    ]
    saves = {name: {3: FORMATS} for name, _ in runs}
    saved = run_world(4, train_and_save, runs, str(tmp_path), saves, None, timeout=400)
    assert [h[0] for h in saved[0][0]["history"]] == [2, 3, 5]
    # Legacy files: one per EP rank (ranks 0 and 1 hold different experts).
    assert sorted(p.name for p in (tmp_path / "moe" / "torch" / "iter_0000003").iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
    ]
    jobs = [(name, run, fmt, 3, ()) for name, run in runs for fmt in FORMATS]
    resumed = run_world(4, resume, jobs, str(tmp_path), timeout=400)
    for rank in range(4):
        assert saved[rank][0]["params"] != saved[rank ^ 1][0]["params"]  # EP peers: other experts
        assert saved[rank][2]["params"] == saved[rank ^ 1][2]["params"]  # CP peers: the same
        for (name, _run, _fmt, it, _conv), result in zip(jobs, resumed[rank], strict=True):
            reference = saved[rank][[n for n, _ in runs].index(name)]
            _same_run(reference, result, it)


@pytest.mark.slow
def test_context_parallel_group_plumbing_with_a_test_only_cp_attention():
    """CP2 x DP2 on 4 ranks (CP groups (0,1),(2,3); arms over DP: ranks 0,1 and 2,3), with the
    test-only all-gather CP attention of tests/cp_worker.py."""
    sgd = dict(optimizer="sgd", clip_grad=0.0, weight_decay=0.0)
    same = dict(spread=0.0, arm_data=True, optimizer=sgd, steps=3, period=5)
    cases = {
        "cp1": dict(cp=1, steps=1, period=1),  # DP4 with Megatron's own attention: the reference
        "global": dict(),
        "arm": dict(grad_sync="arm"),
        "distopt_arm": dict(grad_sync="arm", use_distributed_optimizer=True, bf16=True),
        "same_global": dict(same),
        "same_arm": dict(same, grad_sync="arm"),
    }
    results = run_world(4, cp_cases, cases, timeout=600)
    # The stand-in is exact attention: the CP ranks' mean loss is the full sequence's loss.
    cp_loss = (results[0]["global"]["steps"][0]["loss"] + results[1]["global"]["steps"][0]["loss"]) / 2
    assert cp_loss == pytest.approx(results[0]["cp1"]["steps"][0]["loss"], rel=1e-5)
    for name in ("global", "arm", "distopt_arm"):
        runs = [r[name] for r in results]
        assert [r["arm"] for r in runs] == [0, 0, 1, 1] and [r["row"] for r in runs] == [0, 1, 2, 3]
        assert (
            all(r["reporter"] for r in runs) and [r["grad_arm"] for r in runs] == [(0, 1)] * 2 + [(2, 3)] * 2
        )
        converges = 0
        for step, entries in enumerate(zip(*(r["steps"] for r in runs), strict=True)):
            d = [e["digest"] for e in entries]
            assert d[0] == d[1] and d[2] == d[3], (name, step)  # CP ranks of a replica: same values
            if entries[0]["converged"]:
                converges += 1
                assert len(set(d)) == 1, (name, step)
            else:
                assert d[0] != d[2], (name, step)
        assert converges == 2
        # The loss reporter counts CP: an arm's window loss is the mean over its CP ranks' rows.
        for w, arm_losses in enumerate(runs[0]["windows"]):
            for arm, ranks in ((0, (0, 1)), (1, (2, 3))):
                local = [runs[r]["steps"][s]["loss"] for r in ranks for s in (2 * w, 2 * w + 1)]
                assert arm_losses[arm] == pytest.approx(sum(local) / len(local), rel=1e-12)
    for out in results:
        # Gradient scaling: 1/(DP x CP) globally, 1/(CP ranks of the arm) in arm mode.
        assert out["global"]["scaling"] == [0.25] and out["global"]["grad_cross_bytes"] > 0
        assert out["arm"]["scaling"] == [0.5] and out["arm"]["grad_cross_bytes"] == 0
        assert out["distopt_arm"]["grad_cross_bytes"] == 0
        for x, y in zip(out["same_arm"]["params"], out["same_global"]["params"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_tp2_cp2_dp2_groups_distributed_optimizer_instances_and_training():
    results = run_world(8, cp_layouts, timeout=400)
    for rank, out in enumerate(results):
        # rank = tp + 2 cp + 4 dp; arms over DP (without CP), gradients over DP x CP.
        tp, cp, dp = rank % 2, (rank // 2) % 2, rank // 4
        cross = (rank % 4, rank % 4 + 4)
        assert out["plain"] == (dp, (rank,), cross, (4 * dp + tp, 4 * dp + tp + 2), 2 * dp + cp)
        assert "num_distributed_optimizer_instances=2" in out["distopt_1"]
        assert out["distopt_2"] == (4 * dp + tp, 4 * dp + tp + 2)
        assert out["arm"]["grad_cross_bytes"] == 0 and out["global"]["grad_cross_bytes"] > 0
        assert out["arm"]["scaling"] == [0.5] and out["global"]["scaling"] == [0.25]
        assert out["global"]["reporter"] == (tp == 0) and out["global"]["row"] == 2 * dp + cp
    for name in ("global", "arm"):
        for step in range(4):
            d = [out[name]["steps"][step]["digest"] for out in results]
            converged = results[0][name]["steps"][step]["converged"]
            assert converged == (step in (1, 3))
            for rank in range(8):
                assert d[rank] == d[rank ^ 2], (name, step, rank)  # CP peers: same values
                assert (d[rank] == d[rank ^ 4]) == converged, (name, step, rank)  # the other arm
        assert results[0][name]["windows"][0][0] != results[0][name]["windows"][0][1]


@pytest.mark.slow
def test_virtual_pipeline_arms_converge_and_resume(tmp_path):
    """PP2 x DP2 with the interleaved schedule (two model chunks per rank, 4 layers), 2 arms,
    T=2: the replicas of each stage differ mid-window and are identical after every converge;
    a mid-window save (iteration 3, both formats) resumes bit-identically in a new world."""
    run = Run(pp=2, arms=2, period=2, steps=6, setup=dict(vpp=2, num_layers=4))
    saved = run_world(
        4, train_and_save, [("vpp", run)], str(tmp_path), {"vpp": {3: FORMATS}}, None, timeout=400
    )
    assert [h[0] for h in saved[0][0]["history"]] == [2, 3, 5]
    for rank in range(4):
        assert saved[rank][0]["chunks"] == 2
    # rank = dp + 2 pp: DP replicas of a stage are ranks (0, 1) and (2, 3). Digests are taken
    # after each iteration's step (before iteration 3's save converges); iteration 1 runs at the
    # warm-up's LR 0, so the arms part from iteration 2 on.
    for it in range(2, 7):
        for a, b in ((0, 1), (2, 3)):
            same = saved[a][0]["digests"][it] == saved[b][0]["digests"][it]
            assert same == (it in (2, 5)), (it, a, b)
    jobs = [("vpp", run, fmt, 3, ()) for fmt in FORMATS]
    resumed = run_world(4, resume, jobs, str(tmp_path), timeout=400)
    for rank in range(4):
        for result in resumed[rank]:
            _same_run(saved[rank][0], result, 3)
