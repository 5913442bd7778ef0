"""HDETOneCycleLR: drop-in OneCycleLR, plus fan-out / converge / controller on gloo ranks."""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.controller import NonFiniteArm
from hdet_megatron.schedule import OneCycleSchedule
from hdet_megatron.spread import arm_spread
from hdet_megatron.torch_scheduler import HDETOneCycleLR, MissingLoss
from tests.harness import run_world
from tests.onecycle_trace import toy_optimizer, trace_scheduler

# ----------------------------------------------------------------------------- helpers


def _rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_rng(a, b) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1] == b[1]
        and a[2][0] == b[2][0]
        and np.array_equal(a[2][1], b[2][1])
        and a[2][2:] == b[2][2:]
    )


def _model(seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _batch(gen: torch.Generator):
    x = torch.randn(16, 4, generator=gen)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    return x, y


CASES = [
    ("sgd", 1, 40, {"max_lr": 0.1}),
    ("sgd", 3, 33, {"max_lr": [0.1, 0.02, 1.7], "anneal_strategy": "linear", "base_momentum": 0.8}),
    ("adam", 2, 50, {"max_lr": [1e-3, 3e-4], "three_phase": True, "pct_start": 0.25}),
    (
        "adam",
        1,
        29,
        {
            "max_lr": 3e-4,
            "three_phase": True,
            "anneal_strategy": "linear",
            "div_factor": 10.0,
            "final_div_factor": 100.0,
        },
    ),
    ("sgd", 2, 20, {"max_lr": 0.5, "cycle_momentum": False}),
]

# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("kind,groups,total,kw", CASES)
@pytest.mark.parametrize(
    "hdet",
    [
        None,
        HDETConfig(period=7, axes=(Axis("lr", 0.0),), auto=False),
        HDETConfig(period=5, axes=(Axis("lr", 0.0),), auto=True),  # one arm: neutral controller
    ],
    ids=["off", "spread0-auto-off", "spread0-auto-on"],
)
def test_equals_torch_onecycle_single_rank(kind, groups, total, kw, hdet):
    assert not dist.is_initialized()
    ref_lrs, ref_moms, _ = trace_scheduler(torch.optim.lr_scheduler.OneCycleLR, kind, groups, total, **kw)
    lrs, moms, sched = trace_scheduler(HDETOneCycleLR, kind, groups, total, extra={"hdet": hdet}, **kw)
    assert lrs == ref_lrs and moms == ref_moms  # == on floats: bit-exact, every step
    pure = OneCycleSchedule(
        total_steps=total, num_groups=groups, **{k: v for k, v in kw.items() if k != "cycle_momentum"}
    )
    assert lrs == [pure.lrs(t) for t in range(total + 1)]
    if hdet is not None:
        assert sched.get_last_base_lr() == lrs[-1]
        assert sched.controller.scale("lr") == 1.0
        assert sched.num_arms == 1 and sched.arm == 0


def test_epochs_and_state_dict_like_torch():
    opt, ref_opt = toy_optimizer("sgd", 1), toy_optimizer("sgd", 1)
    sched = HDETOneCycleLR(opt, 0.1, epochs=3, steps_per_epoch=4)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, 0.1, epochs=3, steps_per_epoch=4)
    assert isinstance(sched, torch.optim.lr_scheduler.OneCycleLR)
    assert sched.total_steps == 12 and sched.state_dict().keys() == ref.state_dict().keys()
    for _ in range(12):
        opt.step(), ref_opt.step(), sched.step(), ref.step()
        assert sched.get_last_lr() == ref.get_last_lr()
    with pytest.raises(ValueError, match="Tried to step 13 times"):
        sched.step()
    with pytest.raises(ValueError, match="total_steps"):
        HDETOneCycleLR(toy_optimizer("sgd", 1), 0.1)


def _step_trace(sched, opt, steps: int, key: str) -> list:
    """(last LR, momentum / beta1 of every group) after each of ``steps`` more steps."""
    out = []
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append((sched.get_last_lr(), [g[key][0] if key == "betas" else g[key] for g in opt.param_groups]))
    return out


NEUTRAL = HDETConfig(period=3, axes=(Axis("lr", 0.0),), auto=False)


@pytest.mark.parametrize("hdet", [None, NEUTRAL], ids=["off", "neutral"])
@pytest.mark.parametrize(
    "kind,kw",
    [
        ("sgd", {"anneal_strategy": "linear"}),
        ("adam", {"three_phase": True, "pct_start": 0.25}),  # cycle_momentum on Adam's beta1
    ],
)
def test_legacy_onecycle_state_steps_like_torch(kind, kw, hdet):
    """A state saved by an older torch ``OneCycleLR`` (``anneal_func``, no ``_anneal_func_type``)
    loads into both classes, and both step alike; so does an instance whose ``__dict__`` never had
    ``_anneal_func_type`` (an old pickled scheduler): torch falls back to ``anneal_func`` there."""
    key = "betas" if kind == "adam" else "momentum"
    donor_opt = toy_optimizer(kind, 2)
    donor = torch.optim.lr_scheduler.OneCycleLR(donor_opt, [0.1, 0.3], total_steps=20, **kw)
    for _ in range(5):
        donor_opt.step(), donor.step()
    legacy = donor.state_dict()
    kind_of_anneal = legacy.pop("_anneal_func_type")
    legacy["anneal_func"] = donor._annealing_cos if kind_of_anneal == "cos" else donor._annealing_linear
    legacy["_anneal_func_type_was"] = "removed"  # an unknown extra key loads too (torch: setattr)
    pairs = []
    for drop_type in (False, True):
        ref_opt, opt = toy_optimizer(kind, 2), toy_optimizer(kind, 2)
        ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, [0.1, 0.3], total_steps=20, **kw)
        ours = HDETOneCycleLR(opt, [0.1, 0.3], total_steps=20, hdet=hdet, **kw)
        for o in (ref_opt, opt):
            o.load_state_dict(donor_opt.state_dict())
        ref.load_state_dict(dict(legacy))
        ours.load_state_dict(dict(legacy))
        if drop_type:
            del ref._anneal_func_type, ours._anneal_func_type
        assert ours.get_last_lr() == ref.get_last_lr() == donor.get_last_lr()
        pairs.append((_step_trace(ours, opt, 15, key), _step_trace(ref, ref_opt, 15, key)))
    for got, want in pairs:
        assert got == want  # bit-exact, every step
    assert pairs[0][1] == _step_trace(donor, donor_opt, 15, key)  # and the same as never saved


@pytest.mark.parametrize("hdet", [None, NEUTRAL], ids=["off", "neutral"])
def test_legacy_state_edge_cases_like_torch(hdet):
    """Where an older state and the new instance disagree, torch's rule holds in both classes: the
    instance's ``_anneal_func_type`` wins over a loaded ``anneal_func`` of the other strategy; an
    unknown ``_anneal_func_type`` is the same ValueError at the next step; a state without
    ``_last_lr`` / ``use_beta1`` (older still) keeps the instance's."""
    donor_opt = toy_optimizer("adam", 1)
    donor = torch.optim.lr_scheduler.OneCycleLR(donor_opt, 0.2, total_steps=16, anneal_strategy="cos")
    for _ in range(4):
        donor_opt.step(), donor.step()
    legacy = donor.state_dict()
    del legacy["_anneal_func_type"], legacy["_last_lr"], legacy["use_beta1"]
    legacy["anneal_func"] = donor._annealing_cos
    built = []
    for cls, extra in ((torch.optim.lr_scheduler.OneCycleLR, {}), (HDETOneCycleLR, {"hdet": hdet})):
        opt = toy_optimizer("adam", 1)
        sched = cls(opt, 0.2, total_steps=16, anneal_strategy="linear", **extra)
        opt.load_state_dict(donor_opt.state_dict())
        sched.load_state_dict(dict(legacy))
        built.append((sched, opt))
    (ref, ref_opt), (ours, opt) = built
    assert ours.get_last_lr() == ref.get_last_lr()  # the instance's initial _last_lr, in both
    assert _step_trace(ours, opt, 6, "betas") == _step_trace(ref, ref_opt, 6, "betas")
    # Step 10 of 16 on the second (anneal) phase, linear as the instance says (cos would differ):
    peak = float(0.3 * 16) - 1
    pct = (10 - peak) / (16 - 1 - peak)
    want = torch.optim.lr_scheduler.OneCycleLR._annealing_linear(0.2, 0.2 / 25 / 1e4, pct)
    assert ref.get_last_lr() == [want] != [donor._annealing_cos(0.2, 0.2 / 25 / 1e4, pct)]
    for sched, o in built:
        sched._anneal_func_type = "cosine"  # neither 'cos' nor 'linear'
        o.step()
        with pytest.raises(ValueError, match="Unknown _anneal_func_type: cosine"):
            sched.step()


@pytest.mark.parametrize("hdet", [None, NEUTRAL], ids=["off", "neutral"])
def test_last_epoch_resume_like_torch(hdet):
    """``last_epoch=k`` (torch's way to resume without a scheduler state: the optimizer's groups
    already hold initial_lr/max_lr/min_lr and the momenta): the same LRs and betas as torch."""
    kw = {"three_phase": True, "anneal_strategy": "linear", "base_momentum": 0.8, "max_momentum": 0.9}
    donor_opt = toy_optimizer("adam", 2)
    donor = torch.optim.lr_scheduler.OneCycleLR(donor_opt, [1e-3, 5e-3], total_steps=24, **kw)
    for _ in range(7):
        donor_opt.step(), donor.step()
    ref_opt, opt = toy_optimizer("adam", 2), toy_optimizer("adam", 2)
    for o in (ref_opt, opt):
        o.load_state_dict(donor_opt.state_dict())
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, [1e-3, 5e-3], total_steps=24, last_epoch=6, **kw)
    ours = HDETOneCycleLR(opt, [1e-3, 5e-3], total_steps=24, last_epoch=6, hdet=hdet, **kw)
    assert ours.last_epoch == ref.last_epoch == 7
    assert ours.get_last_lr() == ref.get_last_lr() == donor.get_last_lr()
    assert [g["betas"] for g in opt.param_groups] == [g["betas"] for g in ref_opt.param_groups]
    assert _step_trace(ours, opt, 17, "betas") == _step_trace(ref, ref_opt, 17, "betas")
    with pytest.raises(ValueError, match="Tried to step 25 times"):
        opt.step(), ours.step()


def test_short_run_with_a_slow_start_logs_one_caution(caplog):
    with caplog.at_level("WARNING", logger="hdet_megatron.torch_scheduler"):
        HDETOneCycleLR(
            toy_optimizer("sgd", 1), 0.1, total_steps=100, hdet=HDETConfig(period=20, start_scale=0.25)
        )
    assert [r.getMessage() for r in caplog.records if "only 5 windows of 20" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hdet_megatron.torch_scheduler"):
        HDETOneCycleLR(
            toy_optimizer("sgd", 1), 0.1, total_steps=200, hdet=HDETConfig(period=20, start_scale=0.25)
        )
    assert not [r for r in caplog.records if "windows of" in r.getMessage()]


def test_state_dict_hdet_superset_and_plain_checkpoint_loads():
    cfg = HDETConfig(period=4, axes=(Axis("lr", 0.2),))
    opt = toy_optimizer("adam", 1)
    sched = HDETOneCycleLR(opt, 1e-3, total_steps=20, hdet=cfg)
    for _ in range(6):
        opt.step()
        sched.step(torch.tensor(1.5))
    state = sched.state_dict()
    ref_keys = (
        torch.optim.lr_scheduler.OneCycleLR(toy_optimizer("adam", 1), 1e-3, total_steps=20)
        .state_dict()
        .keys()
    )
    assert set(state) == set(ref_keys) | {"hdet"}
    assert state["hdet"]["loss_count"] == 2 and state["hdet"]["loss_sum"] == 3.0
    assert state["hdet"]["controller"]["window"] == 1
    torch.save(state, io.BytesIO())  # picklable
    fresh = HDETOneCycleLR(toy_optimizer("adam", 1), 1e-3, total_steps=20, hdet=cfg)
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 6 and fresh.controller.state_dict() == sched.controller.state_dict()
    assert fresh.state_dict() == state
    # A plain OneCycleLR checkpoint (no "hdet" key) resumes with HDET switched on.
    plain_opt = toy_optimizer("adam", 1)
    plain = torch.optim.lr_scheduler.OneCycleLR(plain_opt, 1e-3, total_steps=20)
    for _ in range(5):
        plain_opt.step()
        plain.step()
    resumed = HDETOneCycleLR(toy_optimizer("adam", 1), 1e-3, total_steps=20, hdet=cfg)
    resumed.load_state_dict(plain.state_dict())
    assert resumed.last_epoch == 5 and resumed.controller.window == 0


def test_metrics_carry_the_window_training_losses():
    opt = toy_optimizer("sgd", 1)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=12, hdet=HDETConfig(period=3, auto=False))
    assert "arm_train_losses" not in sched.metrics()
    for loss in (1.0, 2.0, 4.5):
        opt.step()
        sched.step(torch.tensor(loss))
    assert sched.metrics()["arm_train_losses"] == [2.5]  # the window's mean, one arm
    assert sched.metrics()["arm_values"] == {"lr": [1.0]}  # the ended window's multiplier


def test_errors_and_rng_untouched_single_rank():
    before = _rng_states()
    opt = toy_optimizer("sgd", 2)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=12, hdet=HDETConfig(period=3))
    for _ in range(6):  # one arm: no loss needed (the controller is neutral anyway)
        opt.step()
        sched.step()
    assert sched.last_update is None and sched.controller.scale("lr") == 1.0
    assert sched.metrics()["num_converges"] == 2
    with pytest.raises(NotImplementedError, match="explores only the learning rate"):
        HDETOneCycleLR(
            toy_optimizer("sgd", 1), 0.1, total_steps=5, hdet=HDETConfig(axes=(Axis("dropout", 0.1),))
        )
    with pytest.raises(ValueError, match="must divide"):
        HDETOneCycleLR(toy_optimizer("sgd", 1), 0.1, total_steps=5, hdet=HDETConfig(arms=2))
    with pytest.raises(ValueError, match="matches no param group"):
        HDETOneCycleLR(
            toy_optimizer("sgd", 1), 0.1, total_steps=5, hdet=HDETConfig(axes=(Axis("lr:emb", 0.1),))
        )
    with pytest.raises(ValueError, match="must be a scalar"):
        HDETOneCycleLR(toy_optimizer("sgd", 1), 0.1, total_steps=5, hdet=HDETConfig(period=2)).step(
            torch.ones(2)
        )
    # nonfinite="raise": a NaN window loss stops with the controller's error.
    opt = toy_optimizer("sgd", 1)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=5, hdet=HDETConfig(period=2, nonfinite="raise"))
    opt.step(), sched.step(1.0), opt.step()
    with pytest.raises(Exception, match="non-finite"):
        sched.step(float("nan"))
    assert _same_rng(before, _rng_states())


def test_rollback_restores_last_converged_params():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=10, hdet=HDETConfig(period=2, rollback=True))
    w = model[0].weight
    start = w.detach().clone()
    with torch.no_grad():
        w.add_(1.0)
    opt.step()
    sched.step(1.0)
    opt.step()
    sched.step(1.0)  # converge: snapshot
    converged = w.detach().clone()
    assert torch.equal(converged, start + 1)
    with torch.no_grad():
        w.fill_(float("nan"))
    opt.step()
    sched.step(float("nan"))
    opt.step()
    with pytest.warns(RuntimeWarning, match="restored the last converged parameters"):
        sched.step(float("inf"))
    assert torch.equal(w, converged)
    assert sched.controller.scale("lr") == 0.5 and sched.metrics()["num_rollbacks"] == 1
    assert sched.get_last_lr()[0] == sched.get_last_base_lr()[0] * 0.5


# ----------------------------------------------------------------------------- 4 gloo ranks


def _gather(values, dtype=torch.float64) -> list[list]:
    t = torch.tensor(values, dtype=dtype)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _all_equal_bits(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    bits = [p.view(torch.int64) if p.dtype == torch.float64 else p.view(torch.int32) for p in parts]
    return all(torch.equal(bits[0], b) for b in bits[1:])


def _run(
    rank, world, *, cfg, total, ddp, max_lr=0.05, nan_rank=None, nan_step=None, kind="sgd", resume_at=None
):
    """Train a tiny regression; check the HDET invariants at every step. Returns a summary."""
    torch.manual_seed(0)  # identical init on every rank (also what DDP broadcasts)
    model = _model(seed=1)
    net = DDP(model) if ddp else model
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=max_lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=max_lr, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(100 + rank)  # per-rank data shard; no global RNG
    rng_before = _rng_states()
    sched = HDETOneCycleLR(opt, max_lr, total_steps=total, hdet=cfg, model=model)
    pure = OneCycleSchedule(max_lr, total)
    size_arm = world // sched.num_arms
    assert sched.arm == rank // size_arm
    summary = {"lrs": [], "scales": [], "excluded": [], "converges": 0, "differ_inside": False}
    saved = None
    for t in range(total):
        # Invariants of the LR at step t (window t // period), incl. right after construction.
        window = t // cfg.period
        rho = arm_spread(cfg, sched.num_arms, window)["lr"][sched.arm]
        c = sched.controller.scale("lr")
        lr = sched.get_last_lr()[0]
        assert sched.get_last_base_lr()[0] == pure.lr(t)  # OneCycle shape kept (defect 4)
        assert lr == pure.lr(t) * c * rho
        assert opt.param_groups[0]["momentum" if kind == "sgd" else "betas"] in (
            pure.momentum(t),
            (pure.momentum(t), 0.99),
        )
        lrs = [row[0] for row in _gather([lr])]
        summary["lrs"].append(lrs)
        if cfg.axes[0].spread > 0:
            assert len(set(lrs)) == sched.num_arms  # arms differ in every window, from step 0
            for r in range(world):
                assert lrs[r] == lrs[(r // size_arm) * size_arm]  # equal inside an arm

        x, y = _batch(gen)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if nan_rank == rank and nan_step == t:
            with torch.no_grad():  # this replica blew up
                for p in model.parameters():
                    p.fill_(float("nan"))
            loss = loss * float("nan")
        expected = None
        if nan_rank is not None and (t + 1) % cfg.period == 0 and t >= nan_step > t - cfg.period:
            mine = _flat(model)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            healthy = [e for r, e in enumerate(everyone) if r // size_arm != nan_rank // size_arm]
            expected = torch.stack(healthy).mean(0)
        if (t + 1) % cfg.period:
            summary["differ_inside"] |= not _all_equal_bits(_flat(model))
        sched.step(loss)
        if (t + 1) % cfg.period == 0:  # converged just now
            summary["converges"] += 1
            flat = _flat(model)
            assert _all_equal_bits(flat), f"params differ after converge at step {t + 1}"
            assert torch.isfinite(flat).all()
            upd = sched.last_update
            assert upd.window == window and upd.step == t + 1
            states = [None] * world
            dist.all_gather_object(states, sched.controller.state_dict())
            assert all(s == states[0] for s in states)
            losses = [None] * world
            dist.all_gather_object(losses, [repr(x) for x in upd.arm_losses])
            assert all(ls == losses[0] for ls in losses)
            summary["scales"].append(sched.controller.scale("lr"))
            summary["excluded"].append(list(upd.excluded))
            if expected is not None:
                assert upd.excluded == [nan_rank // size_arm]
                assert torch.allclose(flat, expected, rtol=1e-6, atol=1e-7)
                assert sched.last_stats.weighted
            if world > 1:
                assert sched.last_stats.num_buckets >= 1 and sched.last_stats.bytes > 0
            if resume_at == t + 1:
                saved = {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "opt": copy.deepcopy(opt.state_dict()),
                    "sched": sched.state_dict(),
                    "gen": gen.get_state(),
                }
    assert _same_rng(rng_before, _rng_states()), "the scheduler touched a global RNG (defect 5)"
    summary["final_lr"] = sched.get_last_lr()[0]
    summary["final_base"] = sched.get_last_base_lr()[0]
    summary["params"] = _flat(model).numpy().tobytes()  # plain data: tensors can't cross the queue
    summary["metrics_keys"] = sorted(sched.metrics())
    if saved is not None:
        resumed = _resume(rank, saved, cfg, total, ddp, max_lr, kind, resume_at)
        summary["resumed_params"] = resumed.numpy().tobytes()
    return summary


def _resume(rank, saved, cfg, total, ddp, max_lr, kind, start):
    model = _model(seed=7)  # different init: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    net = DDP(model) if ddp else model
    opt = (
        torch.optim.SGD(model.parameters(), lr=max_lr, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=max_lr, betas=(0.9, 0.99))
    )
    sched = HDETOneCycleLR(opt, max_lr, total_steps=total, hdet=cfg, model=model)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    gen = torch.Generator()
    gen.set_state(saved["gen"])
    for _ in range(start, total):
        x, y = _batch(gen)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
    return _flat(model)


LR_AXIS = (Axis("lr", 0.3),)
#: The runs of the 4-rank world: name -> (config, total steps, max_lr, keyword arguments of _run).
RUNS = {
    # 1. No DDP wrapper (local-SGD style), controller on, 4 arms; resume from a converge point.
    "local": (HDETConfig(period=5, axes=LR_AXIS, seed=3, temperature=0.01), 20, 0.05, {"resume_at": 10}),
    # 2. DDP wrapper (global gradient sync, the paper's setting), Adam, 2 arms of 2 ranks.
    "ddp": (
        HDETConfig(period=4, arms=2, axes=LR_AXIS, seed=5, temperature="auto"),
        16,
        0.01,
        {"ddp": True, "kind": "adam"},
    ),
    # 3. Controller off: spread from step 0 anyway (defects 1/2).
    "auto_off": (HDETConfig(period=6, axes=LR_AXIS, auto=False), 12, 0.05, {"ddp": True}),
    # 4. Rank 2 blows up (NaN params and loss) in window 1: excluded, the others' average wins.
    "nan": (HDETConfig(period=4, axes=LR_AXIS), 12, 0.05, {"nan_rank": 2, "nan_step": 5}),
}


def _scheduler_world(rank, world):
    out = {}
    lr_axis = LR_AXIS
    for name, (cfg, total, max_lr, kw) in RUNS.items():
        out[name] = _run(rank, world, cfg=cfg, total=total, max_lr=max_lr, **{"ddp": False, **kw})
    # 5. Neutral controller (equal losses on every arm): the base LR decays exactly like OneCycle
    #    and the scale never moves (defect 3: the reference code grew the LR ~400x).
    model = _model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    for rule in ("relative", "paper"):
        cfg = HDETConfig(period=3, axes=lr_axis, rule=rule)
        sched = HDETOneCycleLR(opt, 1.0, total_steps=30, hdet=cfg)
        pure = OneCycleSchedule(1.0, 30)
        highest = 0.0
        for t in range(29):
            opt.step()
            sched.step(torch.tensor(0.25))
            assert sched.controller.scale("lr") == 1.0
            assert sched.get_last_base_lr()[0] == pure.lr(t + 1)
            highest = max(highest, sched.get_last_lr()[0])
        assert sched.last_update.moved and sched.last_update.deltas["lr"] == 0.0
        assert sched.controller.num_updates == 9
        rho = arm_spread(cfg, 4, 9)["lr"][rank]
        # Step 29 (the last): the OneCycle minimum times this arm's multiplier; never above max.
        assert sched.get_last_lr()[0] == pure.lr(29) * rho <= pure.min_lrs[0] * 1.3 * (1 + 1e-12)
        assert highest <= 1.3 * (1 + 1e-12)
    # 6. Missing loss on one arm: a clear error on every rank (no hang).
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=10, hdet=HDETConfig(period=2))
    opt.step()
    sched.step(None if rank == 1 else 1.0)
    opt.step()
    with pytest.raises(MissingLoss, match=r"arm\(s\) \[1\] reported no loss"):
        sched.step(None if rank == 1 else 1.0)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=10, hdet=HDETConfig(period=1))
    opt.step()
    with pytest.raises(MissingLoss, match="without any loss"):
        sched.step()
    # 7. nonfinite="raise" on all ranks together.
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = HDETOneCycleLR(opt, 0.1, total_steps=10, hdet=HDETConfig(period=1, nonfinite="raise"))
    opt.step()
    with pytest.raises(NonFiniteArm):
        sched.step(float("nan") if rank == 3 else 1.0)
    return out


@pytest.mark.slow
def test_hdet_on_4_gloo_ranks():
    out = run_world(4, _scheduler_world, timeout=180)
    for name, (cfg, total, max_lr, _) in RUNS.items():
        runs = [o[name] for o in out]
        assert all(r["converges"] == total // cfg.period for r in runs), name
        # The LR table every rank gathered: OneCycle's base x the scale the window started with x
        # the multiplier of the rank's arm in that window (arms of world / A consecutive ranks).
        pure, arms = OneCycleSchedule(max_lr, total), cfg.arms or 4
        scales = [1.0] + runs[0]["scales"]
        expected = [
            [
                pure.lr(t)
                * scales[t // cfg.period]
                * arm_spread(cfg, arms, t // cfg.period)["lr"][r // (4 // arms)]
                for r in range(4)
            ]
            for t in range(total)
        ]
        assert runs[0]["lrs"] == expected, name
        assert all(len(set(row)) == arms for row in expected)  # the arms differ in every window
        assert all(r["params"] == runs[0]["params"] for r in runs)
        assert "last_update" in runs[0]["metrics_keys"] and "converge_bytes" in runs[0]["metrics_keys"]
    local = [o["local"] for o in out]
    assert local[0]["scales"] != [1.0] * 4  # the controller moved (losses differ across arms)
    assert all(r["differ_inside"] for r in local)  # replicas really fan out between converges
    assert all(r["resumed_params"] == r["params"] for r in local)  # bit-exact resume
    ddp = [o["ddp"] for o in out]
    assert all(len(set(row)) == 2 for row in ddp[0]["lrs"])  # 2 arms
    auto_off = [o["auto_off"] for o in out]
    assert auto_off[0]["scales"] == [1.0, 1.0] and len(set(auto_off[0]["lrs"][0])) == 4
    nan = [o["nan"] for o in out]
    assert nan[0]["excluded"] == [[], [2], []]


def test_per_group_lr_axes_single_rank():
    def opt():
        return torch.optim.SGD(
            [
                {"params": [torch.nn.Parameter(torch.zeros(2))], "name": "embedding"},
                {"params": [torch.nn.Parameter(torch.zeros(2))], "name": "dense"},
            ],
            lr=0.1,
            momentum=0.9,
        )

    ref_opt = opt()
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, [0.1, 0.2], total_steps=8)
    hdet_opt = opt()
    cfg = HDETConfig(period=2, axes=(Axis("lr:emb*", 0.1),))
    sched = HDETOneCycleLR(hdet_opt, [0.1, 0.2], total_steps=8, hdet=cfg)
    for _ in range(8):  # one arm: rho = 1, neutral controller -> OneCycle exactly
        ref_opt.step(), ref.step(), hdet_opt.step(), sched.step(1.0)
        assert sched.get_last_lr() == ref.get_last_lr()
    assert sched.controller.scale("lr:emb*") == 1.0
    with pytest.raises(ValueError, match="matches several axes"):
        HDETOneCycleLR(
            opt(), 0.1, total_steps=8, hdet=HDETConfig(axes=(Axis("lr:emb*", 0.1), Axis("lr:embedding", 0.1)))
        )
