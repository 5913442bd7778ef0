"""The ``hdet`` command line (``pyproject.toml``: ``hdet = "hdet_megatron.cli:main"``).

Subcommands:

* ``hdet simulate``: run the controller on the noisy-quadratic simulator
  (:mod:`hdet_megatron.sim`) and print how the LR scale moves toward the known optimum.
* ``hdet report RUN_DIR``: text summary and PNG of a training run's ``metrics.jsonl``
  (:mod:`hdet_megatron.report`).

Each subcommand is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args) -> int`` registered
in :data:`SUBCOMMANDS`; to add one, write the pair and append it there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from hdet_megatron.args import name_the_flag
from hdet_megatron.config import Axis, HDETConfig, HDETConfigError
from hdet_megatron.preflight import OneLineParser, fail, integer, number

__all__ = ["main", "build_parser"]


# --- hdet simulate ----------------------------------------------------------------------------


def _temperature(text: str):
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'auto', got {text!r}")
    return value


#: HDETConfig field -> the simulate flag that sets it (errors name the flag).
_SIMULATE_FLAGS = {
    "period": "--period",
    "axes": "--spread",
    "temperature": "--sigma",
    "meta_lr": "--meta-lr",
    "momentum": "--momentum",
    "rule": "--rule",
    "grad_sync": "--grad-sync",
    "seed": "--seed",
    "start_scale": "--start-scale",
}


def _add_simulate(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="run the auto controller on a noisy quadratic model with a known optimum LR",
        description=(
            "Simulate HDET on a tracking noisy quadratic model (hdet_megatron.sim) whose optimum "
            "LR is known analytically, and print the learned LR scale per window. The base LR is "
            "--base-lr-factor times that optimum (or --base-lr)."
        ),
    )
    p.add_argument("--arms", type=integer(1, 4096), default=8, help="number of arms (default 8)")
    p.add_argument(
        "--replicas-per-arm", type=integer(1, 4096), default=1, help="replicas per arm (default 1)"
    )
    p.add_argument("--period", type=integer(1), default=100, help="converge period T in steps (default 100)")
    p.add_argument(
        "--spread",
        type=number(0),
        default=1.0 / 9.0,
        help="LR spread alpha (default 1/9; < 1 with --kind linear)",
    )
    p.add_argument("--kind", choices=("linear", "log"), default="linear", help="spread kind")
    p.add_argument(
        "--sigma",
        type=_temperature,
        default="auto",
        help="softmax temperature, a number or 'auto' (default auto: the arm losses' std)",
    )
    p.add_argument("--meta-lr", type=number(0), default=0.5, help="controller meta LR lambda (default 0.5)")
    p.add_argument(
        "--momentum",
        type=number(0, below=1),
        default=0.9,
        help="controller momentum beta in [0, 1) (default 0.9)",
    )
    p.add_argument("--rule", choices=("relative", "paper", "newton"), default="relative", help="update rule")
    p.add_argument(
        "--problem",
        choices=("tracking", "budget"),
        default="tracking",
        help="tracking: constant LR, drifting optimum (default); budget: a fixed budget under "
        "warm-up + cosine decay, where window-local signals show the short-horizon bias",
    )
    p.add_argument(
        "--signal",
        choices=("train", "probe", "line", "average"),
        default="train",
        help="controller signal (--problem budget only; see HDETConfig.signal)",
    )
    p.add_argument("--grad-sync", choices=("global", "arm"), default="global", help="gradient sync mode")
    lr = p.add_mutually_exclusive_group()
    lr.add_argument(
        "--base-lr-factor",
        type=number(above=0),
        default=4.0,
        help="base LR as a multiple of the problem's optimum LR (default 4: too high)",
    )
    lr.add_argument("--base-lr", type=number(above=0), default=None, help="absolute base LR")
    p.add_argument(
        "--steps",
        type=integer(1),
        default=None,
        help="training steps (default 20000; 2000 with --problem budget)",
    )
    p.add_argument(
        "--dim",
        type=integer(1, 100000),
        default=None,
        help="problem dimension (default 16; 32 with --problem budget)",
    )
    p.add_argument("--seed", type=integer(0), default=0, help="random seed (default 0)")
    p.add_argument("--every", type=integer(1), default=10, help="print every k-th window (default 10)")
    p.add_argument(
        "--rollback", action="store_true", help="roll back instead of stopping when all arms diverge"
    )
    p.add_argument(
        "--start-scale",
        type=number(above=0),
        default=None,
        help="slow start: the scale the controller starts at (default: 0.25 with a line signal "
        "and the newton rule, else 1)",
    )
    p.add_argument("--no-brake", dest="brake", action="store_false", help="switch the brake off")
    p.add_argument(
        "--no-noise-aware", dest="noise_aware", action="store_false", help="switch noise-aware steps off"
    )
    p.add_argument(
        "--no-warmup-hold",
        dest="warmup_hold",
        action="store_false",
        help="let the LR scale rise while the base schedule warms up",
    )
    p.add_argument(
        "--probe-noise",
        type=number(0),
        default=0.0,
        help="--problem budget: std of each replica's loss at a line point (default 0: exact)",
    )


def _run_budget(args: argparse.Namespace, config: HDETConfig) -> int:
    """``hdet simulate --problem budget``: the controller against a perfect LR sweep."""
    from hdet_megatron.sim import BudgetNQM, simulate_budget

    if args.base_lr is not None:
        print(
            "hdet simulate: --problem budget takes --base-lr-factor (a multiple of the best "
            "peak LR), not --base-lr",
            file=sys.stderr,
        )
        return 2
    try:
        problem = BudgetNQM(dim=args.dim or 32, probe_noise=args.probe_noise)
        result = simulate_budget(
            config,
            args.arms,
            args.base_lr_factor,
            args.steps or 2000,
            replicas_per_arm=args.replicas_per_arm,
            seed=args.seed,
            problem=problem,
        )
    except ValueError as exc:
        print(f"hdet simulate: {exc}", file=sys.stderr)
        return 2
    print(
        f"# budget NQM dim={problem.dim}, {args.arms} arms x {args.replicas_per_arm} replicas, "
        f"{len(result.lrs)} steps (warm-up + cosine to 1/10), T={args.period}, "
        f"spread={args.spread:.4g}, signal={args.signal}, rule={args.rule}, "
        f"meta_lr={args.meta_lr}, momentum={args.momentum}, start scale "
        f"{config.resolve(True, args.arms).config.start_scale:g}, "
        f"brake {'on' if args.brake else 'off'}, noise-aware {'on' if args.noise_aware else 'off'}, "
        f"warm-up hold {'on' if args.warmup_hold else 'off'}, "
        f"probe noise {args.probe_noise:g}"
    )
    print(
        f"# start: peak LR {args.base_lr_factor:g}x the best (a perfect sweep's expected "
        f"final loss {result.best_loss:.4g})"
    )
    print(f"{'window':>6} {'step':>8} {'scale':>9} {'lr/best':>8}  guards")
    last = len(result.scales) - 1
    for k, (scale, update) in enumerate(zip(result.scales, result.updates, strict=True)):
        if k % args.every == 0 or k == last or update.brake:
            print(
                f"{k:>6} {(k + 1) * args.period:>8} {scale:>9.4f} "
                f"{args.base_lr_factor * scale:>8.3f}  {_guards(update)}"
            )
    print(
        f"# expected final loss {result.expected_loss:.4g}: {100 * result.gap:+.1f}% vs the best "
        f"sweep point (this run's own final loss {result.final_loss:.4g})"
    )
    return 0


def _guards(update) -> str:
    """What slow start, the brake and the noise-aware step did in one window (one column)."""
    parts = []
    if update.brake:
        parts.append(f"brake: {update.brake}")
    elif update.hold:
        parts.append(f"hold {update.hold}")
    if "lr" in update.confidence:
        parts.append(f"confidence {update.confidence['lr']:.2f}")
    return "; ".join(parts)


def _run_simulate(args: argparse.Namespace) -> int:
    from hdet_megatron.controller import AllArmsNonFinite
    from hdet_megatron.sim import NQMProblem, best_lr, simulate, steady_state_loss

    if args.problem == "tracking" and args.signal != "train":
        print(
            f"hdet simulate: --signal {args.signal} needs --problem budget (the tracking model "
            "has no data noise or schedule to tell the signals apart)",
            file=sys.stderr,
        )
        return 2
    try:
        config = HDETConfig(
            period=args.period,
            axes=(Axis("lr", args.spread, kind=args.kind),),
            temperature=args.sigma,
            meta_lr=args.meta_lr,
            momentum=args.momentum,
            rule=args.rule,
            grad_sync=args.grad_sync,
            seed=args.seed,
            rollback=args.rollback,
            signal=args.signal,
            start_scale=args.start_scale,
            brake=args.brake,
            noise_aware=args.noise_aware,
            warmup_hold=args.warmup_hold,
        )
        if args.problem == "tracking":
            problem = NQMProblem(dim=args.dim or 16)
    except HDETConfigError as exc:
        return fail("hdet simulate", name_the_flag(str(exc), _SIMULATE_FLAGS))
    except ValueError as exc:
        return fail("hdet simulate", str(exc))
    if args.problem == "budget":
        return _run_budget(args, config)
    args.steps = args.steps or 20000
    args.dim = args.dim or 16
    if args.steps < args.period:
        return fail(
            "hdet simulate",
            f"--steps {args.steps} is shorter than one window (--period "
            f"{args.period}): give --steps >= --period",
        )
    replicas = args.arms * args.replicas_per_arm
    optimum = best_lr(problem, replicas)
    base = args.base_lr if args.base_lr is not None else args.base_lr_factor * optimum
    try:
        result = simulate(
            config,
            args.arms,
            base,
            args.steps,
            replicas_per_arm=args.replicas_per_arm,
            dim=args.dim,
            seed=args.seed,
            problem=problem,
            keep_updates=True,
        )
    except AllArmsNonFinite as exc:
        fail("hdet simulate", f"{exc} (lower --base-lr/--base-lr-factor, or pass --rollback)")
        return 1
    except ValueError as exc:
        return fail("hdet simulate", str(exc))

    print(
        f"# NQM dim={args.dim}, {args.arms} arms x {args.replicas_per_arm} replicas, "
        f"grad_sync={args.grad_sync}, T={args.period}, spread={args.spread:.4g}, "
        f"sigma={args.sigma}, meta_lr={args.meta_lr}, momentum={args.momentum}, rule={args.rule}"
    )
    print(
        f"# optimum lr={optimum:.4g} "
        f"(steady-state loss {steady_state_loss(problem, optimum, replicas):.4g}), "
        f"base lr={base:.4g} ({base / optimum:.3g}x optimum)"
    )
    print(f"{'window':>6} {'step':>8} {'scale':>9} {'lr/opt':>8} {'loss':>10}  guards")
    last = len(result.scales) - 1
    rows = zip(result.steps, result.scales, result.losses, result.updates, strict=True)
    for k, (step, scale, loss, update) in enumerate(rows):
        if k % args.every == 0 or k == last or update.brake:
            lr_opt = base * scale / optimum
            print(f"{k:>6} {step:>8} {scale:>9.4f} {lr_opt:>8.3f} {loss:>10.4g}  {_guards(update)}")
    print(
        f"# final lr={result.final_lr:.4g} ({result.final_lr / optimum:.3f}x optimum), "
        f"final loss={result.final_loss:.4g}, rollbacks={result.rollbacks}"
    )
    return 0


# --- hdet report RUN_DIR ----------------------------------------------------------------------
# The plotting and summary logic lives in hdet_megatron/report.py.


def _add_report(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="plot and summarise a training run (RUN_DIR/metrics.jsonl)",
        description=(
            "Read RUN_DIR/metrics.jsonl (written by examples/pretrain_gpt/pretrain_gpt.py), print "
            "a short summary and write a PNG: training loss per arm and averaged, the LR "
            "trajectory base x scale with the arms' band, validation loss, per-window arm losses."
        ),
    )
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="directory of an HDET training run (--run-dir / --save)"
    )
    p.add_argument("-o", "--output", default=None, help="PNG path (default RUN_DIR/report.png)")
    p.add_argument("--no-plot", action="store_true", help="text summary only")
    p.add_argument(
        "--smooth", type=integer(1), default=None, help="EMA span for the loss curves (default: steps/40)"
    )


def _run_report(args: argparse.Namespace) -> int:
    from hdet_megatron.report import ReportError, report

    if args.output is not None:
        if args.no_plot:
            return fail("hdet report", "-o/--output conflicts with --no-plot: drop one of them")
        parent = os.path.dirname(os.path.abspath(args.output))
        if os.path.isdir(args.output) or not args.output.lower().endswith(".png"):
            return fail("hdet report", f"-o {args.output}: expected a PNG file path ending in .png")
        if not os.path.isdir(parent):
            return fail(
                "hdet report",
                f"-o {args.output}: directory {parent} does not exist; create it or write the PNG elsewhere",
            )
    try:
        text, png = report(args.run_dir, args.output, make_plot=not args.no_plot, smooth=args.smooth)
    except ReportError as exc:
        return fail("hdet report", str(exc))
    except OSError as exc:  # e.g. the PNG cannot be written
        return fail(
            "hdet report",
            f"{exc.filename or args.run_dir}: {exc.strerror or exc}; "
            "pass -o PATH somewhere writable, or --no-plot",
        )
    print(text)
    if png:
        print(f"plot: {png}")
    return 0


# --- registry and entry point -----------------------------------------------------------------

#: name -> (add parser, run). Order = order in ``hdet --help``.
SUBCOMMANDS: dict[str, tuple[Callable, Callable[[argparse.Namespace], int]]] = {
    "simulate": (_add_simulate, _run_simulate),
    "report": (_add_report, _run_report),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``hdet`` argument parser with every registered subcommand."""
    parser = OneLineParser(prog="hdet", description="Hyperparameter-Divergent Ensemble Training (HDET) tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add, _ in SUBCOMMANDS.values():
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hdet``; returns the exit code (0 = success)."""
    args = build_parser().parse_args(argv)
    _, run = SUBCOMMANDS[args.command]
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
