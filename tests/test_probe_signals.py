"""Probe signals (``probe``, ``line``, ``average``) in ``HDETOneCycleLR``: DDP and FSDP2/HSDP on
4 gloo ranks, through the window engine (hdet_megatron.window), and the probe API's misuse."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hdet_megatron import BatchProbe
from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.probe import batch_fingerprint, eval_mode, probe_scalar
from hdet_megatron.torch_scheduler import HDETOneCycleLR
from tests.harness import run_world
from tests.probe_worker import ProbeRun, world_runs


def _check_run(results: list[dict], spec: ProbeRun) -> None:
    """The must-shows of one probed run (all ranks' records)."""
    windows = spec.steps // spec.period
    for r in results:
        # Every probe left the params exactly as training had left them; the global RNG and the
        # model's train mode survived every step (the probes ran in eval mode: no dropout RNG).
        assert r["restored"] == [True] * windows, r["restored"]
        assert r["rng_kept"] and r["mode_kept"]
        # No host sync on non-converge steps; the converge makes its one reduction's.
        assert [n for conv, n in r["syncs"] if not conv] == [0] * (spec.steps - windows)
        assert [conv for conv, _ in r["syncs"]].count(True) == windows
    # Identical controller decisions, updates and line fits on every rank.
    ref = [{k: v for k, v in h.items()} for h in results[0]["history"]]
    for r in results[1:]:
        assert r["history"] == ref
    # After each converge every rank holds the same model.
    for w in range(windows):
        assert len({r["history"][w]["full_digest"] for r in results}) == 1


def _check_line_means(results: list[dict], points_per_window: int) -> None:
    """The line's point losses are the mean of what every rank's probe returned, in order."""
    for w, h in enumerate(results[0]["history"]):
        line = h["line"]
        assert line is not None and len(line["points"]) == points_per_window
        for k, value in enumerate(line["losses"]):
            local = [r["probed"][points_per_window * w + k] for r in results]
            assert math.isclose(value, sum(local) / len(local), rel_tol=1e-6)


def _moved(results: list[dict]) -> None:
    """The controller moved: its scale left the (slow) start, by steps it took itself."""
    history = results[0]["history"]
    start = results[0]["start_scale"]
    moves = [h["update"]["deltas"]["lr"] for h in history if h["update"]["moved"]]
    assert moves and any(d != 0.0 for d in moves), moves
    assert history[-1]["scales"]["lr"] != start, (start, [h["scales"]["lr"] for h in history])


def _same_training(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert ra["digests"] == rb["digests"] and ra["lrs"] == rb["lrs"]


def _resumed_equal(full: list[dict], resumed: list[dict], after: int) -> None:
    for rf, rr in zip(full, resumed, strict=True):
        assert rr["digests"] == {s: d for s, d in rf["digests"].items() if s > after}
        assert rr["lrs"] == {s: v for s, v in rf["lrs"].items() if s > after}
        assert rr["history"] == [h for h in rf["history"] if h["step"] > after]


@pytest.mark.slow
def test_probe_signals_ddp_4_ranks():
    avg = ProbeRun(signal="average", save_at=6)
    probe = ProbeRun(signal="probe", save_at=6)
    specs = [
        avg,
        replace(avg, save_at=None, resume="previous"),
        probe,
        replace(probe, save_at=None, resume="previous"),
        ProbeRun(signal="line", save_at=6),
        replace(ProbeRun(signal="line"), resume="previous"),
        # With the controller off nothing reads the probes: none runs, and training is
        # bit-identical to the train signal's.
        ProbeRun(signal="average", auto=False),
        ProbeRun(signal="train", auto=False),
        # Issue #29 bug 1: arm 1's params turn NaN at the end of window 2; only arm 1 is left
        # out, the line comes from the healthy replicas, nothing rolls back.
        ProbeRun(signal="average", nan_at=6, steps=9),
        ProbeRun(signal="line", nan_at=6, steps=9, config={"rollback": True}),
        # Misuse: "probe" with each rank's own batch (an error at the first window's end), the
        # line signal with one batch everywhere (a warning, and the noise guard sees no noise).
        ProbeRun(signal="probe", batches="own"),
        ProbeRun(signal="average", batches="shared", steps=6),
    ]
    runs = run_world(4, world_runs, specs, timeout=300)
    res = [[runs[r][i] for r in range(4)] for i in range(len(specs))]
    avg_r, avg_resumed, probe_r, probe_resumed, line_r, line_resumed, off, train_off, nan_avg, nan_line = res[
        :10
    ]
    own_probe, shared_avg = res[10:]
    for spec, results in ((avg, avg_r), (probe, probe_r), (specs[4], line_r)):
        _check_run(results, spec)
    _check_line_means(avg_r, 4)
    _check_line_means(line_r, 4)
    # "probe": one shared batch; each arm's signal is the mean of its ranks' probes (one each).
    for w, h in enumerate(probe_r[0]["history"]):
        assert h["line"] is None
        assert h["update"]["arm_losses"] == [probe_r[a]["probed"][w] for a in range(4)]
    for results in (avg_r, probe_r, line_r):
        _moved(results)
    # The slow start is announced once, on rank 0, as a warning that says how to switch it off.
    notices = [m for m in avg_r[0]["warnings"] if "4x below the given LR" in m]
    assert len(notices) == 1 and "--hdet-start-scale 1" in notices[0], avg_r[0]["warnings"]
    assert all(r["warnings"] == [] for r in avg_r[1:])
    # "line" is corrected by the persistence (< 1 before the last window), "average" is not.
    assert [h["line"]["persistence"] for h in avg_r[0]["history"]] == [1.0] * 4
    assert line_r[0]["history"][0]["line"]["persistence"] < 1.0
    # Checkpoint at step 6 (a window's end), resume in fresh objects: bit-identical after.
    _resumed_equal(avg_r, avg_resumed, 6)
    _resumed_equal(probe_r, probe_resumed, 6)
    _resumed_equal(line_r, line_resumed, 6)
    _same_training(off, train_off)
    assert [r["probed"] for r in off] == [[]] * 4  # auto off: no probe ran
    for results in (nan_avg, nan_line):
        last = results[0]["history"][-1]
        assert last["step"] == 6 or results[0]["history"][1]["step"] == 6
        window2 = next(h for h in results[0]["history"] if h["step"] == 6)
        assert window2["update"]["excluded"] == [1]
        assert all(isinstance(x, float) and math.isfinite(x) for x in window2["line"]["losses"])
        finite = [x for a, x in enumerate(window2["update"]["arm_losses"]) if a != 1]
        assert all(isinstance(x, float) and math.isfinite(x) for x in finite)
        assert all(r["num_rollbacks"] == 0 for r in results)
        assert len({r["history"][-1]["full_digest"] for r in results}) == 1
        assert all(h["update"]["excluded"] == [] for h in results[0]["history"] if h["step"] != 6)
    # "probe" on differing batches: the same error on every rank, at the first window's end.
    for r in own_probe:
        assert r["error"] is not None and r["error"].startswith("ProbeBatchMismatch"), r["error"]
        assert "4 distinct among 4 replicas" in r["error"] and r["history"] == []
    # "average" on one batch everywhere: one warning naming the consequence; the replicas' rows
    # agree, so the step's standard error is 0 and its confidence 1 (what the warning says).
    same = [m for m in shared_avg[0]["warnings"] if "every replica probed the same batch" in m]
    assert len(same) == 1 and "standard error is 0" in same[0]
    assert all(r["error"] is None for r in shared_avg)
    for h in shared_avg[0]["history"]:
        assert h["update"]["step_se"]["lr"] == 0.0 and h["update"]["confidence"]["lr"] == 1.0


@pytest.mark.slow
def test_probe_signals_fsdp2_hsdp(tmp_path):
    """FSDP2/HSDP, both ``reshard_after_forward`` settings (issue #29 bug 4: a forward-only
    probe leaves a module that does not reshard after forward unsharded, and a later forward
    would compute with the stale gathered params), checkpoint and resume through DCP, and a
    converge bucket that lost its params' storage (issue #29: ``_check_homes`` under FSDP2)."""
    specs = []
    for reshard in (True, False):
        avg = ProbeRun(signal="average", fsdp=True, replicas=4, reshard_after_forward=reshard)
        specs += [
            replace(avg, save_at=6, save_dir=str(tmp_path / f"avg-{reshard}")),
            replace(avg, resume="previous", save_dir=str(tmp_path / f"avg-{reshard}")),
            ProbeRun(signal="probe", fsdp=True, replicas=2, reshard_after_forward=reshard),
            replace(avg, auto=False),
            ProbeRun(signal="train", fsdp=True, replicas=4, reshard_after_forward=reshard, auto=False),
        ]
    specs.append(ProbeRun(signal="train", fsdp=True, replicas=2, rehome_at=4))
    # The same with "average": its line search must write into the storage FSDP reads now.
    specs.append(ProbeRun(signal="average", fsdp=True, replicas=4, rehome_at=4))
    # "probe" on a really sharded (2 arms x 2 shards) mesh: checkpoint at step 6, resume.
    probe = ProbeRun(signal="probe", fsdp=True, replicas=2, save_dir=str(tmp_path / "probe"))
    specs += [replace(probe, save_at=6), replace(probe, resume="previous")]
    runs = run_world(4, world_runs, specs, timeout=400)
    res = [[runs[r][i] for r in range(4)] for i in range(len(specs))]
    by_setting = [res[:5], res[5:10]]
    for avg_r, resumed, probe_r, off, train_off in by_setting:
        _check_run(avg_r, specs[0])
        _check_run(probe_r, specs[2])
        _check_line_means(avg_r, 4)
        # 4 distinct line points: each probe saw its own point (not stale gathered params).
        for h in avg_r[0]["history"]:
            assert len(set(h["line"]["losses"])) == 4
        _resumed_equal(avg_r, resumed, 6)
        _same_training(off, train_off)
    # Both reshard settings train, probe and decide bit-identically.
    for a, b in zip(by_setting[0], by_setting[1], strict=True):
        for ra, rb in zip(a, b, strict=True):
            assert ra["digests"] == rb["digests"] and ra["history"] == rb["history"]
            assert ra["probed"] == rb["probed"]
    # Storage replaced mid-window (module._apply): the converge still reaches FSDP's params.
    rehomed, rehomed_avg = res[10], res[11]
    for results in (rehomed, rehomed_avg):
        for w in range(len(results[0]["history"])):
            assert len({r["history"][w]["full_digest"] for r in results}) == 1
    _check_line_means(rehomed_avg, 4)
    for h in rehomed_avg[0]["history"]:
        assert len(set(h["line"]["losses"])) == 4  # each point probed where FSDP reads now
    assert all(r["restored"] == [True] * 4 for r in rehomed_avg)
    probe_saved, probe_resumed = res[12], res[13]
    _check_run(probe_saved, specs[12])
    _moved(probe_saved)
    _resumed_equal(probe_saved, probe_resumed, 6)
    # The saving run decided exactly as the one without a checkpoint.
    assert [r["history"] for r in probe_saved] == [r["history"] for r in by_setting[0][2]]


@pytest.mark.slow
def test_line_signals_hsdp_really_sharded_6_ranks(tmp_path):
    """The line signals need >= 3 arms, so on 4 ranks their HSDP mesh is (4, 1): nothing is
    sharded. Here 3 arms x 2 shards: every line point is written into real shards and gathered
    by the probe's forward. Identical decisions on all 6 ranks, bit-exact restore after every
    line search, no host sync off the converge steps, checkpoint (DCP) and resume
    bit-identical, and with the controller off the probes change nothing about training."""
    avg = ProbeRun(signal="average", fsdp=True, replicas=3)
    specs = [
        replace(avg, save_at=6, save_dir=str(tmp_path / "avg")),
        replace(avg, resume="previous", save_dir=str(tmp_path / "avg")),
        ProbeRun(signal="line", fsdp=True, replicas=3, reshard_after_forward=False),
        replace(avg, auto=False),
        ProbeRun(signal="train", fsdp=True, replicas=3, auto=False),
    ]
    runs = run_world(6, world_runs, specs, timeout=400)
    avg_r, resumed, line_r, off, train_off = [[runs[r][i] for r in range(6)] for i in range(len(specs))]
    for results, spec in ((avg_r, specs[0]), (line_r, specs[2])):
        _check_run(results, spec)
        _check_line_means(results, 3)
        for h in results[0]["history"]:
            assert len(set(h["line"]["losses"])) == 3  # each point probed its own params
        _moved(results)
    # Arms are the mesh's replicate dimension: ranks 2a and 2a + 1 shard arm a's copy.
    assert [r["arm"] for r in avg_r] == [0, 0, 1, 1, 2, 2]
    _resumed_equal(avg_r, resumed, 6)
    _same_training(off, train_off)
    assert [r["probed"] for r in off] == [[]] * 6  # auto off: no probe ran


# ----------------------------------------------------------------------------- single process


def test_eval_mode_restores_each_modules_own_mode():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.Dropout(0.5))
    model.train()
    model[2].eval()  # mixed modes
    with eval_mode([model]):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, True, False]


def test_probe_scalar_and_errors():
    assert probe_scalar(1.5, torch.device("cpu")).dtype == torch.float64
    assert probe_scalar(torch.tensor([2.0]), torch.device("cpu")).shape == ()
    with pytest.raises(ValueError, match="scalar"):
        probe_scalar(torch.ones(3), torch.device("cpu"))
    with pytest.raises(TypeError, match="scalar tensor or a float"):
        probe_scalar("x", torch.device("cpu"))


def test_batch_probe_one_batch_per_window():
    fetched = []
    probe = BatchProbe(lambda b: b, lambda w: fetched.append(w) or f"batch{w}")
    assert (probe.batch(3), probe.batch(3), probe.batch(4)) == ("batch3", "batch3", "batch4")
    assert fetched == [3, 4]  # fetched once per window
    assert probe.loss("x") == "x"
    it = BatchProbe(lambda b: b, iter([10, 20]))
    assert (it.batch(0), it.batch(0), it.batch(1)) == (10, 10, 20)
    with pytest.raises(RuntimeError, match="ran out at window 2"):
        it.batch(2)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        BatchProbe(None, [1])
    with pytest.raises(TypeError, match="batches must be"):
        BatchProbe(lambda b: b, 3)


def test_batch_fingerprint_tells_batches_apart():
    cpu = torch.device("cpu")
    x = torch.arange(12.0).reshape(3, 4)
    batch = {"tokens": x, "labels": x.long() + 1}
    same = {"labels": x.long() + 1, "tokens": x.clone()}  # dict order does not matter
    assert torch.equal(batch_fingerprint(batch, cpu), batch_fingerprint(same, cpu))
    # A permutation, one changed entry, a shift between tensors: all different.
    for other in (
        {"tokens": x.flip(0), "labels": x.long() + 1},
        {"tokens": x + (torch.arange(12.0).reshape(3, 4) == 5), "labels": x.long() + 1},
        {"tokens": x.long() + 1, "labels": x},
    ):
        assert not torch.equal(batch_fingerprint(batch, cpu), batch_fingerprint(other, cpu))
    assert batch_fingerprint(["no tensors", 3], cpu) is None
    assert batch_fingerprint((x, [x]), cpu).dtype == torch.float64


def test_a_bare_callable_is_refused_with_the_recipe():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(4, 2) for _ in range(3)]
    draws = iter(batches)

    def fresh_batch_per_call():  # the natural mistake: a new batch at every point of a window
        return model(next(draws)).pow(2).mean()

    with pytest.raises(TypeError, match="must be a BatchProbe") as err:
        HDETOneCycleLR(opt, 0.1, total_steps=4, hdet=HDETConfig(), model=model, probe_fn=fresh_batch_per_call)
    assert "BatchProbe(lambda b:" in str(err.value) and "\n" not in str(err.value)
    # The documented recipe passes, and gives the probe defaults.
    sched = HDETOneCycleLR(
        opt,
        0.1,
        total_steps=4,
        hdet=HDETConfig(),
        model=model,
        probe_fn=BatchProbe(lambda b: model(b).pow(2).mean(), lambda w: batches[w % 3]),
    )
    assert sched.hdet.signal == "train"  # one process: one arm, no line (needs >= 3 arms)


def test_probe_signals_need_probe_fn_and_model():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = BatchProbe(lambda b: 0.0, [None])
    with pytest.raises(ValueError, match="needs a probe; probe_fn=BatchProbe"):
        HDETOneCycleLR(opt, 0.1, total_steps=4, hdet=HDETConfig(signal="probe"), model=model)
    # A probe without the model is refused, not ignored (it would resolve to the train signal).
    for config in (HDETConfig(signal="probe"), HDETConfig()):
        with pytest.raises(ValueError, match="probe_fn needs model="):
            HDETOneCycleLR(opt, 0.1, total_steps=4, hdet=config, probe_fn=probe)
    line = HDETConfig(signal="average", axes=(Axis("lr", 0.3),), rule="newton")
    with pytest.raises(ValueError, match="needs a probe"):
        HDETOneCycleLR(opt, 0.1, total_steps=4, hdet=line, model=model)
