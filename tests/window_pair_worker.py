"""Rank-side code of the runtime-pair tests: the same windows through two runtimes' adapters.

One 4-rank world (DP4 = 4 arms) holds a Megatron-Core ``HDET`` over the toy GPT (fp32, Megatron
DDP, Megatron's optimizer and ``HDETOptimizerParamScheduler``) and its torch twin: an
``HDETOneCycleLR`` over a module whose parameters are copies of Megatron's main params, in the
same order. No optimizer steps are taken: every step writes the same iterate into both,
``theta_t = theta0 - rho_arm * (t / T) * D`` (``D`` a fixed direction, ``rho`` the arm's spread
value of the window), and hands both the same per-step training loss; the probe scores the same
function of the params on the same batches. Both base schedules are constant (Megatron's
``constant`` decay, OneCycle with both div factors 1), so the ``line`` signal's persistence is 1 in
both (the two schedulers' shapes differ otherwise). What each runtime's window engine then
decides must be identical to the bit: the ``ControllerUpdate``, the line fit, a rollback and the
averaged params.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.probe import BatchProbe
from hdet_megatron.torch_scheduler import HDETOneCycleLR


@dataclass
class PairRun:
    signal: str
    period: int = 3
    windows: int = 3
    config: dict = field(default_factory=dict)
    nan_window: int | None = 1
    """In this window arm 1's iterate is NaN at the last step (the exclusion path)."""
    all_nan_window: int | None = None
    """In this window every arm's iterate is NaN at the last step (rollback, with ``rollback``)."""


def _direction(params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(77)
    return [0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _targets(params: list[torch.Tensor], key: int, window: int) -> list[torch.Tensor]:
    """A held-out "batch": one target per tensor, a pure function of the stream and window."""
    gen = torch.Generator().manual_seed(10_000 + 100 * key + window)
    return [0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]


def _score(params: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """A smooth, non-quadratic function of the params (float64 on both sides, same order)."""
    total = torch.zeros((), dtype=torch.float64)
    for p, t in zip(params, targets, strict=True):
        d = p.detach().double() - t
        total = total + torch.log1p((d * d).mean())
    return total


def _train_loss(rank: int, step: int) -> torch.Tensor:
    """This replica's (synthetic) training loss of ``step``: the same in both runtimes."""
    return torch.tensor(2.0 + 0.1 * math.sin(rank + 0.7 * step), dtype=torch.float64)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _write(targets: list[torch.Tensor], origin, direction, scale: float) -> None:
    with torch.no_grad():
        for p, p0, d in zip(targets, origin, direction, strict=True):
            torch.add(p0, d, alpha=-scale, out=p)


def pair(rank: int, world: int, run: PairRun) -> dict:
    from hdet_megatron.megatron import toy
    from hdet_megatron.megatron.runtime import HDET, main_params
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

    from megatron.core import parallel_state as ps

    setup = toy.ToyGPTSetup(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8)
    steps = run.period * run.windows
    settings = dict(
        period=run.period,
        axes=(Axis("lr", 0.3),),
        signal=run.signal,
        rule="newton" if run.signal in ("line", "average") else "relative",
        meta_lr=1.0,
        momentum=0.5,
        start_scale=0.5,
        temperature="auto",
    )
    config = HDETConfig(**{**settings, **run.config})
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        kwargs = {**toy.scheduler_kwargs(setup, steps, warmup=0), "lr_decay_style": "constant"}
        scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
        mega = main_params(optimizer)
        # "probe": one batch stream for every replica; the line signals: each replica its own.
        key = 0 if run.signal == "probe" else ps.get_data_parallel_rank()
        twin = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in mega])
        tensors = list(twin.parameters())

        def probe_for(params):
            return BatchProbe(lambda batch: _score(params, batch), lambda w: _targets(params, key, w))

        megatron_probe = BatchProbe(
            lambda batch: [{"lm loss": _score(mega, batch)}], lambda w: _targets(mega, key, w)
        )
        use_probe = run.signal != "train"
        hdet = HDET(config, model, optimizer, scheduler, probe_fn=megatron_probe if use_probe else None)
        sched = HDETOneCycleLR(
            torch.optim.SGD(tensors, lr=0.1),
            max_lr=0.1,
            total_steps=steps + 1,
            div_factor=1.0,
            final_div_factor=1.0,
            hdet=config,
            model=twin,
            probe_fn=probe_for(tensors) if use_probe else None,
        )
        direction = _direction(mega)
        out: dict = {"megatron": [], "torch": [], "digests": []}
        step = 0
        for window in range(run.windows):
            rho_m = scheduler.arm_spread_values()["lr"][hdet.layout.arm]
            rho_t = sched.arm_multipliers()[sched.arm]
            assert rho_m == rho_t, (rho_m, rho_t)
            origin_m = [p.detach().clone() for p in mega]
            origin_t = [p.detach().clone() for p in tensors]
            metrics = None
            for t in range(1, run.period + 1):
                step += 1
                scale = rho_m * t / run.period
                _write(mega, origin_m, direction, scale)
                _write(tensors, origin_t, direction, scale)
                last = t == run.period
                arm_nan = window == run.nan_window and hdet.layout.arm == 1
                if last and (arm_nan or window == run.all_nan_window):
                    with torch.no_grad():
                        for p in mega + tensors:
                            p.fill_(math.nan)
                loss = _train_loss(ps.get_data_parallel_rank(), step)
                scheduler.step(1)
                metrics = hdet.step([{"lm loss": loss}])
                sched.step(loss)
            assert metrics is not None
            end = sched._hdet.engine.last  # the torch runtime's record of the same window
            assert end is not None
            out["megatron"].append(
                {
                    "update": metrics.update,
                    "line": metrics.line,
                    "scales": metrics.scales,
                    "rolled_back": metrics.rolled_back,
                }
            )
            out["torch"].append(
                {
                    "update": end.update.to_dict() if end.update is not None else None,
                    "line": end.line.to_dict() if end.line is not None else None,
                    "scales": sched.controller.scales(),
                    "rolled_back": end.rolled_back,
                }
            )
            out["digests"].append((_digest(mega), _digest(tensors)))
        hdet.close()
        sched.close()
    return out


def pair_world(rank: int, world: int, runs: list[PairRun]) -> list[dict]:
    return [pair(rank, world, run) for run in runs]
