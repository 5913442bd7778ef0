"""Checkpoints of HDET runs (issue 5): converge-on-save, bit-exact resume in new processes, the
resume rules, corrupted state.

The multi-rank tests write real Megatron checkpoints (legacy ``torch.save`` and
``dist_checkpointing`` torch_dist) from one world and resume them in a second, new world.
"""

from __future__ import annotations

import pytest

from tests.checkpoint_worker import Run, line_origin, resume, rules, train_and_save
from tests.harness import run_world

FORMATS = ("torch", "torch_dist")


def _same_run(reference: dict, resumed: dict, start: int) -> None:
    """``resumed`` (from iteration ``start``) equals ``reference`` from there on, bit for bit."""
    assert resumed["losses"] == {s: v for s, v in reference["losses"].items() if s > start}
    assert resumed["params"] == reference["params"]
    assert resumed["scales"] == reference["scales"]
    assert resumed["window"] == reference["window"]
    assert resumed["history"] == [h for h in reference["history"] if h[0] > start]


@pytest.mark.slow
def test_tp2_pp2_dp2_resume_in_new_processes_is_bit_exact(tmp_path):
    """TP2 x PP2 x DP2 (8 gloo ranks, 2 arms, T=2): train 2.5 windows, save mid-window (the save
    converges) and at a window boundary, in both checkpoint kinds; a new world resumes each and
    trains on. Also the distributed optimizer with partial instances (PP2 x DP4, 2 arms = 2
    optimizer instances of 2 ranks each), torch_dist with dp_reshardable and legacy."""
    mp = Run(tp=2, pp=2, period=2, steps=7)
    distopt = Run(pp=2, arms=2, dist_opt=True, period=2, steps=7)
    saves = {"mp": {4: FORMATS, 5: FORMATS}, "distopt": {5: FORMATS}}
    runs = [("mp", mp), ("distopt", distopt), ("mp_converge", mp)]
    # World 1: the uninterrupted runs that save (and one that only converges at iteration 5).
    saved_mp, saved_distopt, converged = zip(
        *run_world(8, train_and_save, runs, str(tmp_path), saves, {"mp_converge": (5,)}, timeout=600),
        strict=True,
    )
    # Saving changes nothing but the forced converge: identical to a run that converged at 5.
    for a, b in zip(saved_mp, converged, strict=True):
        assert a["losses"] == b["losses"] and a["params"] == b["params"]
        assert a["history"] == b["history"]
    history = saved_mp[0]["history"]
    assert [h[0] for h in history] == [2, 4, 5, 7]  # 5: the converge of the mid-window save
    assert history[-1][1]["lr"] != 1.0  # the controller moved, so its state matters
    # World 2: new processes resume every checkpoint and train to the end.
    # (From the boundary checkpoint at 4 the resumed run converges at 5, where the reference saved.)
    jobs = [("mp", mp, fmt, it, (5,) if it == 4 else ()) for it in (4, 5) for fmt in FORMATS]
    jobs += [("distopt", distopt, fmt, 5, ()) for fmt in FORMATS]
    resumed = run_world(8, resume, jobs, str(tmp_path), timeout=600)
    for rank in range(8):
        for (name, _run, _fmt, it, _conv), result in zip(jobs, resumed[rank], strict=True):
            reference = saved_mp[rank] if name == "mp" else saved_distopt[rank]
            _same_run(reference, result, it)


@pytest.fixture(scope="module")
def rule_results(tmp_path_factory):
    return run_world(2, rules, str(tmp_path_factory.mktemp("rules")), timeout=600)


@pytest.mark.slow
def test_plain_megatron_checkpoint_starts_hdet_at_scale_1(rule_results):
    for r in rule_results:
        got = r["plain_to_hdet"]
        assert got["iteration"] == got["hdet_iteration"] == got["num_steps"] == 3
        assert got["scales"] == {"lr": 1.0} and got["window"] == 0
        assert got["params_equal"] and got["logged"]
        assert got["lr"] == got["expected_lr"]  # base schedule at iteration 3 * 1 * rho_arm
        assert got["converged_at"] == [6]  # a full window of T=3 steps after the resume


@pytest.mark.slow
def test_loaded_checkpoint_starts_the_first_update_line(tmp_path):
    """signal="line": after a plain Megatron checkpoint, or an HDET one without runtime state, the
    first window's line runs through the loaded params (issue 29, bug 2), not the initial ones."""
    for r in run_world(4, line_origin, str(tmp_path), timeout=600):
        for name, got in r.items():
            start, history, probes = got["marked"]
            assert start == 3 and [h[0] for h in history] == [6], name  # one window after the load
            assert len(probes) == 4, name  # its line probed at the 4 arms' multipliers
            assert got["auto"] == got["marked"], name


@pytest.mark.slow
def test_no_load_optim_keeps_the_loaded_bf16_weights(rule_results):
    """load_optimizer=False (--no-load-optim) with bf16: the fp32 main params are refreshed from
    the loaded model (Megatron-LM's reload_model_params; issue 29, bug 3)."""
    for r in rule_results:
        for name, by_format in r["no_load_optim"].items():
            for fmt, got in by_format.items():
                assert got["params"]["model"] == got["saved"]["model"], (name, fmt)
                # The masters are the loaded bf16 weights in fp32 (not the saved fp32 masters: no
                # optimizer state was loaded), not the initial ones.
                assert got["params"] == got["refreshed"], (name, fmt)
                assert got["initial"]["main"] != got["params"]["main"], (name, fmt)


@pytest.mark.slow
def test_hdet_checkpoint_loads_into_plain_megatron_scheduler_warning_once(rule_results):
    for r in rule_results:
        got = r["hdet_to_plain"]
        assert got["warnings"] == 1  # three loads (both kinds), one warning
        assert got["num_steps"] == 4 and not got["has_hdet_key"]
        assert got["params_equal"]  # the averaged model


@pytest.mark.slow
def test_arm_count_or_dp_size_change_keeps_scale_restarts_windows(rule_results):
    for r in rule_results:
        saved = r["saved"]
        for key in ("arms_changed", "dp_changed"):
            got = r[key]
            assert got["scales"] == saved["scales"] and saved["scales"]["lr"] != 1.0
            assert got["window"] == saved["window"]
            assert len(got["logged"]) == 1 and "windows restarted" in got["logged"][0]
        assert "this run 1 arm(s) over DP 2" in r["arms_changed"]["logged"][0]
        assert "this run 1 arm(s) over DP 1" in r["dp_changed"]["logged"][0]
        assert r["arms_changed"]["steps_in_window"] == 0
        # TP1 x DP2 -> TP2 x DP1 through torch_dist resharding: it trains on.
        assert sorted(r["dp_changed"]["losses"]) == [5, 6, 7]


@pytest.mark.slow
def test_changed_config_checkpoint_wins_unless_overridden(rule_results):
    for r in rule_results:
        wins = r["config_checkpoint_wins"]
        assert wins["period"] == wins["sched_period"] == 3 and wins["temperature"] == 0.05
        assert len(wins["logged"]) == 1 and "period (checkpoint 3, this run 4)" in wins["logged"][0]
        for label in ("flag", "megatron_flag"):
            assert r["config_override"][label]["period"] == 4
            assert r["config_override"][label]["scales"] == r["saved"]["scales"]
        assert "period: checkpoint 3 vs this run 4" in r["config_strict"]
        assert r["config_strict_untouched"]
        # checkpoint_hdet_config(root): the saved config (both kinds), None for a plain checkpoint.
        assert r["checkpoint_config"] == [True, True, None]


@pytest.mark.slow
def test_corrupted_checkpoint_clear_error_nothing_modified(rule_results):
    for r in rule_results:
        assert "['controller']" in r["corrupt"] and "'oops' must be a number" in r["corrupt"]
        assert r["corrupt_untouched"]


@pytest.mark.slow
def test_save_without_converge_keeps_window_losses_and_late_runtime(rule_results):
    for r in rule_results:
        got = r["noconv"]
        assert got["saved"]["steps_in_window"] == 1 and got["saved"]["arm_loss_sums"] is not None
        assert got["loaded"] == got["saved"]
        assert got["warned"]


@pytest.mark.slow
def test_homed_main_params_write_the_same_checkpoint_bytes(rule_results):
    """fp32 params, bf16 masters and DistOpt bf16 shards homed in the converge buckets: both
    checkpoint kinds are byte-identical to the same state stored without homing, and load back."""
    for r in rule_results:
        for name, got in r["homed_files"].items():
            files = got["files"]
            assert any(f.endswith(".pt") for f in files) and any(f.endswith(".distcp") for f in files)
            different = [f for f, (same, _) in files.items() if not same]
            assert not different, (name, different)
            assert got["loaded"] == {"torch": True, "torch_dist": True}, name
