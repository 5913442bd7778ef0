"""Generalization of auto-LR (issue 35): fifteen tasks, each against its own LR sweep and the
LR-free optimizers a user would pick instead of a sweep.

    .venv/bin/pip install -e '.[bench]'                                  # schedulefree, prodigyopt
    .venv/bin/python benchmarks/generalize.py --tasks megatron-8x onecycle-ddp --seeds 1234
    .venv/bin/python benchmarks/generalize.py --tasks megatron-wsd hsdp-cosine --held-out --seeds 1 2 3
    .venv/bin/python benchmarks/generalize.py --table-only                 # tables from the results
    # the rows at an earlier sweep's best LRs (one per seed), without running the sweep again:
    .venv/bin/python benchmarks/generalize.py --tasks onecycle-ddp --seeds 1 2 --best-lr 2e-3 4e-3

Every run uses 4 local gloo ranks = 4 data-parallel replicas = 4 HDET arms. Per task and seed:

- ``sweep-x{f}``: the task's own plain baseline at ``centre * f``, f = 1/4 .. 4, extended
  outwards until the best point has a worse point on each side;
- ``def-x{g}``: HDET with nothing but the period given (the defaults: ``average`` + ``newton``,
  slow start, brake, noise-aware steps), from ``g`` = 1/4, 1 and 4 times the best sweep LR;
- ``off-x{g}``: the same with auto-LR off (spread and converge only) at the same guesses; its
  default spread is 1/9 since BENCHMARKS.md 3k (the ``off-x`` rows of 3e-3k ran at 0.3);
- ``sf-x{g}``: Schedule-Free AdamW at the same guesses (its own warm-up over the task's warm-up
  steps, no schedule, evaluated in its eval mode);
- ``prodigy``: Prodigy at lr 1 under the task's schedule shape (no guess at all);
- ``fixed-x{g}`` (``--fixed``): the controller probes and logs its line and step every window but
  never moves the LR: the signal without feedback, for ``benchmarks/signal_audit.py``.

**Protocol.** ``megatron-8x`` and ``onecycle-ddp`` are the *tuning* tasks: the controller may be
changed after looking at them. ``megatron-wsd``, ``hsdp-cosine``, ``megatron-longwu`` (a 25%
warm-up, added later for rules that act only in a warm-up), ``hsdp-longwu`` (FSDP2 with a 20%
warm-up, added after the warm-up hold was frozen), ``ddp-shortwu`` and ``megatron-wide`` (added
after 3i, before any run of them, for the narrow spread with a wide line), ``ddp-long`` (40
small windows, added after 3n before any run of it), ``megatron-constant`` and ``ddp-period25``
(3q), ``megatron-accum`` and ``ddp-wide`` (3s) and ``megatron-deep`` and ``ddp-nowarm`` (3t),
each defined before any run of it, are *held out*: they run once, with nothing changed, after
the rule is frozen, and the runner refuses them without ``--held-out``.
A finished run (its ``final`` record present) is not run again; ``--force`` reruns.
Results: ``generalize.json`` (one row per run), ``generalize.md`` (per task: every row's final
validation loss and its gap to that seed's best sweep point) under ``--out``; the per-window
controller data stay in each run's ``metrics.jsonl`` (``benchmarks/plots.py --controller``
draws them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402  (the Megatron example's run construction)

NPROC = 4
TORCH_WORKER = os.path.join(ROOT, "benchmarks", "gen_torch.py")
MEGATRON_LAUNCHER = os.path.join(ROOT, "benchmarks", "gen_megatron.py")

#: Guesses (multiples of the best sweep LR) of the HDET, auto-off and Schedule-Free rows.
GUESSES = (0.25, 1.0, 4.0)
#: The first sweep: centre * 2**k, k = -2..2.
SWEEP_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class Variant:
    """One ``--variants`` entry: what its rows change over the defaults."""

    prototypes: tuple[str, ...] = ()
    """``hdet_megatron.controller.PROTOTYPES`` switched on."""
    spread: float | None = None
    """The LR spread the arms train with (``--spread`` / ``--hdet-spread``; None: the default)."""
    auto: bool = True
    """Auto-LR on (False: spread and converge only)."""
    line_width: float | None = None
    """``HDETConfig.line_width`` (``--line-width`` / ``--hdet-line-width``; None: the default)."""
    warmup_hold: bool = True
    """``HDETConfig.warmup_hold`` (False: ``--no-warmup-hold`` / ``--no-hdet-warmup-hold``)."""


#: ``wline``/``narrow``/``offn``: the narrow training spread (3j).
NARROW_SPREAD = 0.05
#: ``wline``: the half-width of the line's points (the default LR spread with a line signal).
WIDE_LINE_WIDTH = 0.3
#: Controller prototypes, spreads, line widths and config fields (``--variants``) over the
#: defaults, measured as rows ``{name}-x{g}`` at the same guesses (on the tuning tasks only).
#: ``nohold``: the warm-up hold off (the defaults before it, 3i); ``wline``: the line scored
#: wider than the arms train; ``narrow``: the narrow spread alone (the line at the arms' own
#: points); ``offn``: the narrow spread with auto-LR off (what it costs); ``off9``: auto-LR off
#: at the paper's spread of 1/9 (3k). The variants of the prototypes rejected in 3e-3s went with
#: them (BENCHMARKS.md 3e: the rows of 3e-3m rerun at commit b3a601d; 3p: ``holdfirst``'s at
#: commit b32f5fe; 3r: ``jk16`` and ``jk16s`` at commit 6a105d6; 3s: ``drise`` at commit
#: 3e7d803).
VARIANTS: dict[str, Variant] = {
    "nohold": Variant(warmup_hold=False),
    "wline": Variant(spread=NARROW_SPREAD, line_width=WIDE_LINE_WIDTH),
    "narrow": Variant(spread=NARROW_SPREAD),
    "offn": Variant(spread=NARROW_SPREAD, auto=False),
    "off9": Variant(spread=1.0 / 9.0, auto=False),
}
#: How far a sweep may extend past its first five points looking for a bracketed best.
MAX_EXTENSIONS = 3


@dataclass(frozen=True)
class Task:
    """One benchmark task: a path (``megatron`` or ``torch``), its model, data and schedule."""

    name: str
    held_out: bool
    path: str
    center_lr: float
    period: int
    steps: int
    warmup: int
    """Warm-up iterations (Megatron) or steps (OneCycleLR: ``pct_start * steps``)."""
    summary: str
    options: dict[str, float | int | str] = field(default_factory=dict)
    """Megatron: ``quality.add_model_flags`` values and ``extra`` flags; torch: ``gen_torch.py``."""

    @property
    def role(self) -> str:
        return "held out" if self.held_out else "tuning"


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            name="megatron-8x",
            held_out=False,
            path="megatron",
            center_lr=2e-3,
            period=10,
            steps=120,
            warmup=8,
            summary="the Megatron example (BENCHMARKS 3d's 8x batch, shortened): GPT 4x128, seq 128, "
            "global batch 64, cosine to LR/10 after an 8-iteration warm-up, 12 windows of 10 "
            "iterations, 20,480 tokens per arm per window",
            options=dict(layers=4, hidden=128, heads=4, seq=128, global_batch=64, micro_batch=16),
        ),
        Task(
            name="onecycle-ddp",
            held_out=False,
            path="torch",
            center_lr=4e-3,
            period=10,
            steps=240,
            warmup=72,
            summary="byte-level GPT in plain torch, DDP, AdamW + OneCycleLR (30% warm-up, cosine, "
            "torch's div factors), HDETOneCycleLR + BatchProbe as documented, GPT 4x128, seq 128, "
            "8 sequences per rank, 24 windows of 10 steps, 10,240 tokens per arm per window",
            options=dict(width=128, layers=4, heads=4, seq=128, batch=8, pct_start=0.3),
        ),
        Task(
            name="megatron-wsd",
            held_out=True,
            path="megatron",
            center_lr=2e-3,
            period=10,
            steps=200,
            warmup=5,
            summary="the Megatron example with warm-up-stable-decay: GPT 3x192, seq 256, global "
            "batch 16, 5-iteration warm-up, constant, linear decay to LR/10 over the last 50 "
            "iterations, 20 windows of 10 iterations, 10,240 tokens per arm per window",
            options=dict(
                layers=3,
                hidden=192,
                heads=6,
                seq=256,
                global_batch=16,
                micro_batch=4,
                extra="--lr-decay-style WSD --lr-wsd-decay-iters 50 --lr-wsd-decay-style linear",
            ),
        ),
        Task(
            name="megatron-longwu",
            held_out=True,
            path="megatron",
            center_lr=2e-3,
            period=10,
            steps=160,
            warmup=40,
            summary="the Megatron example with a long warm-up (added after 3g, for rules frozen on "
            "the tuning tasks that act only in a warm-up): GPT 2x160, seq 128, global batch 32, "
            "40-iteration (25%) warm-up, linear decay to LR/10, 16 windows of 10 iterations, "
            "10,240 tokens per arm per window",
            options=dict(
                layers=2,
                hidden=160,
                heads=5,
                seq=128,
                global_batch=32,
                micro_batch=8,
                extra="--lr-decay-style linear",
            ),
        ),
        Task(
            name="hsdp-longwu",
            held_out=True,
            path="torch",
            center_lr=3e-3,
            period=10,
            steps=200,
            warmup=40,
            summary="byte-level GPT in plain torch on FSDP2 (HSDP mesh 4 replicas x 1 shard) with a "
            "long warm-up (added after 3h, for the warm-up hold frozen there): AdamW + OneCycleLR "
            "with a 20% warm-up from LR/25 and a cosine decay to LR/100, GPT 3x128, seq 64, 16 "
            "sequences per rank, 20 windows of 10 steps, 10,240 tokens per arm per window",
            options=dict(
                width=128,
                layers=3,
                heads=4,
                seq=64,
                batch=16,
                pct_start=0.2,
                final_div_factor=100.0,
                fsdp=1,
            ),
        ),
        Task(
            name="ddp-shortwu",
            held_out=True,
            path="torch",
            center_lr=3e-3,
            period=10,
            steps=200,
            warmup=20,
            summary="byte-level GPT in plain torch, DDP, wider and shallower (added after 3i, for "
            "the narrow spread with a wide line, frozen before any run of it): AdamW + OneCycleLR "
            "with a 10% warm-up from LR/25 and a cosine decay to LR/1000, GPT 2x192, seq 64, 24 "
            "sequences per rank, 20 windows of 10 steps, 15,360 tokens per arm per window",
            options=dict(
                width=192,
                layers=2,
                heads=6,
                seq=64,
                batch=24,
                pct_start=0.1,
                final_div_factor=40.0,
            ),
        ),
        Task(
            name="megatron-wide",
            held_out=True,
            path="megatron",
            center_lr=2e-3,
            period=10,
            steps=150,
            warmup=12,
            summary="the Megatron example, wider and shallower (added after 3i with "
            "ddp-shortwu): GPT 2x256, seq 128, global batch 24, 12-iteration warm-up, cosine "
            "decay to LR/10, 15 windows of 10 iterations, 7,680 tokens per arm per window",
            options=dict(layers=2, hidden=256, heads=8, seq=128, global_batch=24, micro_batch=6),
        ),
        Task(
            name="ddp-long",
            held_out=True,
            path="torch",
            center_lr=3e-3,
            period=10,
            steps=400,
            warmup=60,
            summary="byte-level GPT in plain torch, DDP, a longer run of small windows (added after "
            "3n, defined before any run of it, held out for the next candidate): AdamW + "
            "OneCycleLR with a 15% warm-up from LR/25 and a cosine decay to LR/100, GPT 3x96, seq "
            "64, 8 sequences per rank, 40 windows of 10 steps, 5,120 tokens per arm per window",
            options=dict(
                width=96,
                layers=3,
                heads=4,
                seq=64,
                batch=8,
                pct_start=0.15,
                final_div_factor=4.0,
            ),
        ),
        Task(
            name="megatron-constant",
            held_out=True,
            path="megatron",
            center_lr=2e-3,
            period=15,
            steps=150,
            warmup=10,
            summary="the Megatron example, deeper and narrower, at a constant LR (added after 3p, "
            "defined before any run of it and before any candidate, held out for the next one): "
            "GPT 6x96, seq 128, global batch 32, 10-iteration warm-up, then constant, 10 windows "
            "of 15 iterations, 15,360 tokens per arm per window",
            options=dict(
                layers=6,
                hidden=96,
                heads=4,
                seq=128,
                global_batch=32,
                micro_batch=8,
                extra="--lr-decay-style constant",
            ),
        ),
        Task(
            name="ddp-period25",
            held_out=True,
            path="torch",
            center_lr=3e-3,
            period=25,
            steps=250,
            warmup=25,
            summary="byte-level GPT in plain torch, DDP, long windows (added after 3p with "
            "megatron-constant, defined before any run of it): AdamW + OneCycleLR with a 10% "
            "warm-up from LR/25 and a cosine decay to LR/100, GPT 4x96, seq 64, 16 sequences per "
            "rank, 10 windows of 25 steps, 25,600 tokens per arm per window",
            options=dict(
                width=96,
                layers=4,
                heads=4,
                seq=64,
                batch=16,
                pct_start=0.1,
                final_div_factor=4.0,
            ),
        ),
        Task(
            name="megatron-accum",
            held_out=True,
            path="megatron",
            center_lr=2e-3,
            period=15,
            steps=180,
            warmup=20,
            summary="the Megatron example with gradient accumulation and a warm-up longer than a "
            "window (added after 3r, defined before any run of it and before the next candidate): "
            "GPT 3x128, seq 128, global batch 32 in micro-batches of 2 (4 per arm per step), "
            "weight decay 0.1, 20-iteration warm-up, cosine decay to LR/10, 12 windows of 15 "
            "iterations, 15,360 tokens per arm per window",
            options=dict(
                layers=3,
                hidden=128,
                heads=4,
                seq=128,
                global_batch=32,
                micro_batch=2,
                extra="--weight-decay 0.1",
            ),
        ),
        Task(
            name="ddp-wide",
            held_out=True,
            path="torch",
            center_lr=3e-3,
            period=12,
            steps=240,
            warmup=48,
            summary="byte-level GPT in plain torch, DDP, wide and shallow (added after 3r with "
            "megatron-accum, defined before any run of it): AdamW + OneCycleLR with a 20% "
            "warm-up from LR/25 and a cosine decay to LR/250, GPT 2x160, seq 96, 8 sequences per "
            "rank, 20 windows of 12 steps, 9,216 tokens per arm per window",
            options=dict(
                width=160,
                layers=2,
                heads=5,
                seq=96,
                batch=8,
                pct_start=0.2,
                final_div_factor=10.0,
            ),
        ),
        Task(
            name="hsdp-cosine",
            held_out=True,
            path="torch",
            center_lr=3e-3,
            period=20,
            steps=200,
            warmup=10,
            summary="byte-level GPT in plain torch on FSDP2 (HSDP mesh 4 replicas x 1 shard: 2x2 "
            "would give 2 arms, the line signal needs 3), AdamW + OneCycleLR with a 5% warm-up "
            "from LR/10 and a cosine decay to LR/10, GPT 3x96, seq 64, 16 sequences per rank, "
            "10 windows of 20 steps, 20,480 tokens per arm per window",
            options=dict(
                width=96,
                layers=3,
                heads=4,
                seq=64,
                batch=16,
                pct_start=0.05,
                div_factor=10.0,
                final_div_factor=1.0,
                fsdp=1,
            ),
        ),
        Task(
            name="megatron-deep",
            held_out=True,
            path="megatron",
            center_lr=2e-3,
            period=12,
            steps=144,
            warmup=10,
            summary="the Megatron example, deep and narrow with few tokens per window (added after "
            "3t, defined before any run of it and before the next candidate): GPT 6x96, seq 128, "
            "global batch 16 (4 sequences per arm per step), 10-iteration warm-up, linear decay to "
            "LR/10, 12 windows of 12 iterations, 6,144 tokens per arm per window",
            options=dict(
                layers=6,
                hidden=96,
                heads=4,
                seq=128,
                global_batch=16,
                micro_batch=4,
                extra="--lr-decay-style linear",
            ),
        ),
        Task(
            name="ddp-nowarm",
            held_out=True,
            path="torch",
            center_lr=2e-3,
            period=10,
            steps=200,
            warmup=10,
            summary="byte-level GPT in plain torch, DDP, no warm-up (added after 3t with "
            "megatron-deep, defined before any run of it): AdamW + OneCycleLR starting at the peak "
            "(div factor 1, 5% flat) and a cosine decay to LR/40, GPT 3x96, seq 128, 6 sequences "
            "per rank, 20 windows of 10 steps, 7,680 tokens per arm per window",
            options=dict(
                width=96,
                layers=3,
                heads=4,
                seq=128,
                batch=6,
                pct_start=0.05,
                div_factor=1.0,
                final_div_factor=40.0,
            ),
        ),
    )
}


@dataclass(frozen=True)
class Run:
    """One row of a task's table: what trains, at which LR."""

    row: str
    """``sweep-x0.5``, ``def-x1``, ``off-x4``, ``sf-x0.25``, ``prodigy``, ``fixed-x1``."""
    group: str
    """``sweep``, ``def``, ``off``, ``sf``, ``prodigy``, ``proto`` or ``fixed``."""
    lr: float
    guess: float | None
    """The LR as a multiple of the best sweep LR (None: the sweep's and Prodigy's rows)."""
    variant: Variant = Variant()
    """``proto`` rows: what the variant changes (the defaults for every other row)."""


def fmt_factor(f: float) -> str:
    return f"{f:g}"


def sweep_runs(task: Task, factors: Sequence[float]) -> list[Run]:
    return [Run(f"sweep-x{fmt_factor(f)}", "sweep", task.center_lr * f, None) for f in factors]


def method_runs(best_lr: float, variants: Sequence[str] = (), fixed: bool = False) -> list[Run]:
    """The rows that need the best sweep LR (and Prodigy, which needs none), then the variants',
    then (``fixed``) the signal audit's ``fixed-x{g}`` rows."""
    runs = []
    for group in ("def", "off", "sf"):
        runs += [Run(f"{group}-x{fmt_factor(g)}", group, best_lr * g, g) for g in GUESSES]
    runs.append(Run("prodigy", "prodigy", 1.0, None))
    for name in variants:
        runs += [Run(f"{name}-x{fmt_factor(g)}", "proto", best_lr * g, g, VARIANTS[name]) for g in GUESSES]
    if fixed:
        runs += [Run(f"fixed-x{fmt_factor(g)}", "fixed", best_lr * g, g) for g in GUESSES]
    return runs


def next_sweep_factors(done: dict[float, float]) -> list[float]:
    """Sweep factors still to run: the best point needs a worse neighbour on each side."""
    if not done:
        return list(SWEEP_FACTORS)
    best = min(done, key=lambda f: done[f])
    return [f for f in (best / 2, best * 2) if f not in done]


# -------------------------------------------------------------------------------- command lines
def megatron_base(task: Task, seed: int, data_prefix: str, eval_iters: int) -> list[str]:
    opts = dict(task.options)
    extra = str(opts.pop("extra", ""))
    ns = argparse.Namespace(
        steps=task.steps, warmup=task.warmup, eval_iters=eval_iters, **{k: opts[k] for k in opts}
    )
    return quality.model_args(ns, data_prefix, seed) + shlex.split(extra)


def torch_base(task: Task, seed: int) -> list[str]:
    flags = ["--steps", str(task.steps), "--period", str(task.period), "--seed", str(seed)]
    for key, value in task.options.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def command(task: Task, run: Run, seed: int, data_prefix: str, eval_iters: int) -> list[str]:
    """The torchrun arguments (after ``--nproc-per-node``) of one run, without ``--run-dir``."""
    variant = run.variant
    sets = [f"--prototype={name}" for name in variant.prototypes]
    if task.path == "torch":
        modes = {"sweep": "plain", "def": "hdet", "proto": "hdet", "off": "hdet-off", "fixed": "hdet-fixed"}
        mode = modes.get(run.group, run.group)  # sf, prodigy
        if not variant.auto:
            mode = "hdet-off"
        if variant.spread is not None:
            sets.append(f"--spread={variant.spread:g}")
        if variant.line_width is not None:
            sets.append(f"--line-width={variant.line_width:g}")
        if not variant.warmup_hold:
            sets.append("--no-warmup-hold")
        return [TORCH_WORKER, "--mode", mode, "--lr", f"{run.lr:.6g}", *torch_base(task, seed), *sets]
    base = megatron_base(task, seed, data_prefix, eval_iters)
    if run.group == "proto":
        flags = [*quality.lr_flags(run.lr), "--hdet-period", str(task.period)]
        flags += [] if variant.spread is None else ["--hdet-spread", f"{variant.spread:g}"]
        flags += [] if variant.line_width is None else ["--hdet-line-width", f"{variant.line_width:g}"]
        flags += [] if variant.auto else ["--no-hdet-auto"]
        flags += [] if variant.warmup_hold else ["--no-hdet-warmup-hold"]
        if not variant.prototypes:  # config fields only (spread, line width, ...): the example itself
            return [quality.SCRIPT, *base, *flags]
        # The example with the variant's prototypes switched on (benchmark only).
        return [MEGATRON_LAUNCHER, *sets, "--", *base, *flags]
    if run.group == "sweep":
        return [quality.SCRIPT, *base, *quality.lr_flags(run.lr), "--no-hdet"]
    if run.group in ("def", "off"):
        flags = ["--hdet-period", str(task.period)] + (["--no-hdet-auto"] if run.group == "off" else [])
        return [quality.SCRIPT, *base, *quality.lr_flags(run.lr), *flags]
    if run.group == "fixed":  # the signal without feedback (signal_audit.py): probes on, LR never moved
        flags = ["--hdet-period", str(task.period), "--hdet-meta-lr", "0", "--hdet-start-scale", "1"]
        return [quality.SCRIPT, *base, *quality.lr_flags(run.lr), *flags, "--no-hdet-brake"]
    if run.group == "sf":  # constant LR from Megatron's scheduler; Schedule-Free warms up itself
        flags = ["--lr", f"{run.lr:.6g}", "--min-lr", f"{run.lr:.6g}", "--lr-decay-style", "constant"]
        flags += ["--lr-warmup-iters", "0", "--no-hdet"]
        return [MEGATRON_LAUNCHER, "--peer", "sf", "--peer-warmup", str(task.warmup), "--", *base, *flags]
    # Prodigy: lr 1 with the task's schedule shape (min LR = LR/10 as every run here).
    return [MEGATRON_LAUNCHER, "--peer", "prodigy", "--", *base, *quality.lr_flags(1.0), "--no-hdet"]


# ------------------------------------------------------------------------------------ results
def read_windows(run_dir: str) -> list[dict]:
    """The ``window`` records of a run's ``metrics.jsonl`` (both paths write the same shape)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("type") == "window":
                    out.append(rec)
    return out


def read_final(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    final = None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "final":
                final = rec
    return final


def execute(
    cmd: list[str], run_dir: str, force: bool, log: Callable[[str], None]
) -> tuple[dict, float | None]:
    """Run one torchrun job unless it finished before; returns its final record and wall seconds."""
    done = None if force else read_final(run_dir)
    if done is not None:
        return done, None
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):  # an unfinished run's records would be appended to: start clean
        os.remove(metrics)
    full = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        f"--nproc-per-node={NPROC}",
        *cmd,
        "--run-dir",
        run_dir,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo")
    shown = " ".join(shlex.quote(os.path.relpath(c) if c.startswith(ROOT) else c) for c in cmd)
    log(f"start {os.path.relpath(run_dir)}: {shown}")
    start = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as f:
        proc = subprocess.run(full, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    done = read_final(run_dir)
    if proc.returncode != 0 or done is None:
        raise SystemExit(f"{run_dir} failed (exit {proc.returncode}); see its stdout.log")
    return done, seconds


def newton_branch(line: dict) -> str:
    """Which branch of the ``newton`` rule a window's line fit took: ``min`` (the fitted minimum,
    inside the 2x bound), ``clip+``/``clip-`` (a minimum beyond the bound: the step is clipped to
    2x / 1/2), ``edge+``/``edge-`` (no minimum, q <= 0: the descent end of the arms' range)."""
    g, q = line["corrected_slope"], line["curvature"]
    if not q > 0:
        return "edge+" if g < 0 else "edge-"
    target = 1.0 - g / q
    if target > 2.0:
        return "clip+"
    if target < 0.5:
        return "clip-"
    return "min"


def controller_trace(run_dir: str) -> list[dict]:
    """Per window of an HDET run: the line fit (``g``, corrected ``g``, ``q``, ``kappa``), the
    newton branch, the raw step (log of the target factor, before the noise-aware shrink), its
    jackknife se and confidence, the applied step, the scale after the update and the brake."""
    out = []
    for w in read_windows(run_dir):
        update, line = w.get("update") or {}, w.get("line")
        lr = lambda d: (d or {}).get("lr", math.nan)  # noqa: E731
        out.append(
            {
                "window": update.get("window", w.get("window")),
                "iteration": w["iteration"],
                "base_lr": w.get("base_lr"),
                "g": line["slope"] if line else math.nan,
                "g_corrected": line["corrected_slope"] if line else math.nan,
                "q": line["curvature"] if line else math.nan,
                "kappa": line["persistence"] if line else math.nan,
                "branch": newton_branch(line) if line else "",
                "raw_step": lr(update.get("raw_deltas")),
                "step_se": lr(update.get("step_se")),
                "confidence": lr(update.get("confidence")),
                "step": lr(update.get("deltas")),
                "scale": lr(update.get("scales") or w.get("scales")),
                "brake": update.get("brake"),
            }
        )
    return out


def summarize(task: Task, run: Run, seed: int, final: dict, run_dir: str, seconds: float | None) -> dict:
    loss = final["valid_loss"]
    windows = read_windows(run_dir)
    scales = final.get("scales") or {}
    return {
        "task": task.name,
        "role": task.role,
        "row": run.row,
        "group": run.group,
        "seed": seed,
        "lr": run.lr,
        "guess": run.guess,
        "valid_loss": loss if isinstance(loss, (int, float)) and math.isfinite(loss) else math.inf,
        "final_scale": scales.get("lr", 1.0),
        "wall_seconds": seconds,
        "train_seconds": final.get("train_seconds"),
        "windows": len(windows),
        "brakes": sum(1 for w in windows if (w.get("update") or {}).get("brake")),
        "run_dir": os.path.relpath(run_dir, ROOT),
    }


def best_sweep(rows: list[dict], task: str, seed: int) -> dict | None:
    sweep = [r for r in rows if r["task"] == task and r["seed"] == seed and r["group"] == "sweep"]
    return min(sweep, key=lambda r: r["valid_loss"]) if sweep else None


def median_scale(row: dict) -> float:
    """The median over a run's windows of the LR scale after each update (1 without windows):
    where the controller kept the LR (the last window's scale is moot: nothing trains after it)."""
    if "median_scale" in row:
        return float(row["median_scale"])
    run_dir = row.get("run_dir")
    windows = read_windows(os.path.join(ROOT, run_dir)) if run_dir else []
    scales = sorted(float((w.get("scales") or {}).get("lr", 1.0)) for w in windows)
    if not scales:
        return 1.0
    mid = len(scales) // 2
    return scales[mid] if len(scales) % 2 else (scales[mid - 1] + scales[mid]) / 2


def markdown_tables(rows: list[dict]) -> str:
    """Per task: every row's validation loss and gap to the same seed's best sweep point (mean
    over seeds with min..max), the plain sweep point at the same LR where there is one, the LR
    the run trained at (guess x the controller's median scale) and the wall time per run."""
    out = []
    order = {"sweep": 0, "def": 1, "proto": 2, "off": 3, "sf": 4, "prodigy": 5, "fixed": 6}
    for task in TASKS.values():
        trows = [r for r in rows if r["task"] == task.name]
        if not trows:
            continue
        seeds = sorted({r["seed"] for r in trows})
        out.append(f"#### {task.name} ({task.role})\n\n{task.summary}.\n")
        bests = {s: best_sweep(trows, task.name, s) for s in seeds}
        out.append(
            "best sweep point per seed: "
            + ", ".join(
                f"seed {s}: LR {b['lr']:.3g}, valid loss {b['valid_loss']:.4f}"
                for s, b in bests.items()
                if b is not None
            )
            + "\n"
        )
        out.append(
            "| row | seeds | LR / best | valid loss (mean, min..max) | vs best sweep point (mean, "
            "min..max) | plain at that LR | LR / best, median over windows | wall s per run |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        groups: dict[str, list[dict]] = {}
        for r in trows:
            best = bests.get(r["seed"])
            if best is None:
                continue
            # Sweep rows by their LR relative to the seed's best, the others by their name.
            name = f"sweep x{r['lr'] / best['lr']:g}" if r["group"] == "sweep" else r["row"]
            groups.setdefault(name, []).append(r)

        def key(name: str, groups: dict = groups, bests: dict = bests) -> tuple[int, float]:
            rs = groups[name]
            return order[rs[0]["group"]], rs[0]["lr"] / bests[rs[0]["seed"]]["lr"]

        for name in sorted(groups, key=key):
            rs = groups[name]
            rel = [100 * (r["valid_loss"] / bests[r["seed"]]["valid_loss"] - 1) for r in rs]
            loss = [r["valid_loss"] for r in rs]
            factor = rs[0]["lr"] / bests[rs[0]["seed"]]["lr"]
            plain = []
            for r in rs:
                same = [
                    p
                    for p in trows
                    if p["group"] == "sweep" and p["seed"] == r["seed"] and math.isclose(p["lr"], r["lr"])
                ]
                if same and r["group"] != "sweep":
                    plain.append(100 * (same[0]["valid_loss"] / bests[r["seed"]]["valid_loss"] - 1))
            walls = [r["wall_seconds"] for r in rs if r.get("wall_seconds")]
            trained = [r["lr"] * median_scale(r) / bests[r["seed"]]["lr"] for r in rs]
            peer = rs[0]["group"] == "prodigy"
            label = f"**{name}**" if rs[0]["group"] == "sweep" and max(rel) == 0 else name
            out.append(
                f"| {label} | {len(rs)} | {'-' if peer else f'{factor:g}'} | "
                f"{_mean(loss):.4f} ({min(loss):.4f}..{max(loss):.4f}) | "
                f"{_mean(rel):+.2f}% ({min(rel):+.2f}..{max(rel):+.2f}) | "
                f"{f'{_mean(plain):+.2f}%' if plain else ''} | "
                f"{'-' if peer else f'{_mean(trained):.3g}'} | "
                f"{f'{_mean(walls):.0f}' if walls else ''} |"
            )
        out.append("")
    return "\n".join(out)


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


# ------------------------------------------------------------------------------------- driver
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["megatron-8x", "onecycle-ddp"], choices=sorted(TASKS))
    p.add_argument(
        "--held-out",
        action="store_true",
        help="allow the held-out tasks (run them once, after the rule is frozen)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument(
        "--only", nargs="+", default=None, help="run only these rows (e.g. def-x1 prodigy); the sweep always"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=[],
        choices=sorted(VARIANTS),
        help="controller prototypes to run besides the defaults (rows NAME-x{guess})",
    )
    p.add_argument(
        "--fixed",
        action="store_true",
        help="also run fixed-x{guess}: the controller probes and logs but never moves the LR "
        "(the signal without feedback, for signal_audit.py)",
    )
    p.add_argument(
        "--best-lr",
        type=float,
        nargs="+",
        default=None,
        help="one task: each seed's best sweep LR from an earlier run (as many as --seeds), so the "
        "rows run without the sweep (their table then has no best point to compare with)",
    )
    p.add_argument("--eval-iters", type=int, default=20, help="Megatron tasks' validation batches")
    p.add_argument("--out", default="benchmarks/results/generalize")
    p.add_argument("--force", action="store_true", help="rerun finished runs")
    p.add_argument("--table-only", action="store_true", help="print the tables of the results so far")
    args = p.parse_args(argv)
    refused = [t for t in args.tasks if TASKS[t].held_out]
    if refused and not args.held_out and not args.table_only:
        p.error(
            f"{', '.join(refused)} {'is a held-out task' if len(refused) == 1 else 'are held-out tasks'}: "
            "they run once, with nothing changed, after the rule is frozen (--held-out)"
        )
    if args.best_lr is not None and (len(args.tasks) != 1 or len(args.best_lr) != len(args.seeds)):
        p.error(
            f"--best-lr needs one task and one LR per seed ({len(args.seeds)} seeds, {len(args.best_lr)} LRs)"
        )
    if args.best_lr is not None and not all(lr > 0 for lr in args.best_lr):
        p.error(f"--best-lr {args.best_lr}: LRs must be > 0")
    return args


def load_rows(path: str) -> dict[tuple[str, str, int], dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(r["task"], r["row"], r["seed"]): r for r in json.load(f)["runs"]}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "generalize.json")
    rows = load_rows(results)
    logf = open(os.path.join(args.out, "generalize.log"), "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    def save() -> None:
        with open(results, "w") as f:
            json.dump(
                {"runs": sorted(rows.values(), key=lambda r: (r["task"], r["seed"], r["row"]))}, f, indent=1
            )
        with open(os.path.join(args.out, "generalize.md"), "w") as f:
            f.write(markdown_tables(list(rows.values())) + "\n")

    if not args.table_only:
        data_prefix = quality.default_data_prefix()
        for name in args.tasks:
            task = TASKS[name]
            for index, seed in enumerate(args.seeds):

                def do(run: Run, task: Task = task, seed: int = seed) -> dict:
                    run_dir = os.path.join(args.out, task.name, f"{run.row}-s{seed}")
                    cmd = command(task, run, seed, data_prefix, args.eval_iters)
                    final, seconds = execute(cmd, run_dir, args.force, log)
                    old = rows.get((task.name, run.row, seed))
                    if seconds is None and old is not None:
                        seconds = old.get("wall_seconds")  # keep the time the run took when it ran
                    row = summarize(task, run, seed, final, run_dir, seconds)
                    rows[(task.name, run.row, seed)] = row
                    save()
                    took = f"{seconds:.0f} s" if seconds is not None else "done before"
                    log(f"{task.name} seed {seed} {run.row}: valid {row['valid_loss']:.4f} ({took})")
                    return row

                if args.best_lr is not None:
                    best_lr = args.best_lr[index]
                    log(f"{task.name} seed {seed}: best sweep LR {best_lr:g} given, no sweep run")
                    for run in method_runs(best_lr, args.variants, args.fixed):
                        if not args.only or run.row in args.only:
                            do(run)
                    continue
                sweep: dict[float, float] = {}
                for _ in range(MAX_EXTENSIONS + 1):
                    todo = next_sweep_factors(sweep)
                    if not todo:
                        break
                    for f in todo:
                        sweep[f] = do(sweep_runs(task, [f])[0])["valid_loss"]
                best = min(sweep, key=lambda f: sweep[f])
                if next_sweep_factors(sweep):
                    log(f"{task.name} seed {seed}: sweep not bracketed after {MAX_EXTENSIONS} extensions")
                for run in method_runs(task.center_lr * best, args.variants, args.fixed):
                    if args.only and run.row not in args.only:
                        continue
                    do(run)
    table = markdown_tables(list(rows.values()))
    print(table)
    save()


if __name__ == "__main__":
    main()
