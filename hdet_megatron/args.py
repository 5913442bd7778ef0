"""Megatron-LM style ``--hdet-*`` command-line flags for every :class:`HDETConfig` field.

Shared by ``examples/pretrain_gpt`` and the ``megatron.training`` patch, so both accept the same
flags::

    parser = argparse.ArgumentParser()
    add_hdet_args(parser)
    args = parser.parse_args()
    config = hdet_config_from_args(args)   # None with --no-hdet

Flags: ``--no-hdet``, ``--hdet-period``, ``--hdet-arms``, ``--hdet-grad-sync``,
``--hdet-axis NAME:SPREAD[:MIN:MAX]`` (repeatable; default ``lr`` at 0.3 with auto-LR on a line
signal, else 1/9), ``--hdet-spread`` (shorthand for the LR axis' spread), ``--hdet-spread-kind``,
``--hdet-auto/--no-hdet-auto``, ``--hdet-auto-start``, ``--hdet-temperature`` (float or ``auto``),
``--hdet-meta-lr``, ``--hdet-momentum``, ``--hdet-scale-bounds MIN MAX``, ``--hdet-rule``, ``--hdet-seed``,
``--hdet-bucket-mb``, ``--no-hdet-home-main-params``, ``--hdet-converge-on-save/--no-hdet-converge-on-save``,
``--hdet-nonfinite``, ``--hdet-rollback``, ``--hdet-signal``, ``--hdet-start-scale``,
``--hdet-brake/--no-hdet-brake``, ``--hdet-brake-factor``, ``--hdet-brake-spike``,
``--hdet-brake-rise``, ``--hdet-brake-hold``, ``--hdet-noise-aware/--no-hdet-noise-aware``,
``--hdet-warmup-hold/--no-hdet-warmup-hold``, ``--hdet-line-width``.
Flags left at ``auto`` (signal, rule) or unset (spread, meta LR, momentum, start scale) take the
measured defaults when the run starts (:meth:`HDETConfig.resolve`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import replace

from hdet_megatron.config import PAPER_SPREAD, Axis, HDETConfig, HDETConfigError, parse_axis
from hdet_megatron.preflight import integer, number

_DEFAULT = HDETConfig()


def _temperature(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'auto', got {text!r}") from None


def add_hdet_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the HDET flag group to ``parser`` (Megatron-LM ``extra_args_provider`` compatible)."""
    g = parser.add_argument_group("hdet", "Hyperparameter-Divergent Ensemble Training")
    g.add_argument(
        "--no-hdet",
        dest="hdet",
        action="store_false",
        help="plain Megatron training (no fan-out, no converge, no controller)",
    )
    g.add_argument(
        "--hdet-period",
        type=integer(),
        default=_DEFAULT.period,
        help="converge period T in iterations (default %(default)s)",
    )
    g.add_argument(
        "--hdet-arms",
        type=integer(),
        default=None,
        help="number of arms A (must divide DP; default: one per DP replica)",
    )
    g.add_argument(
        "--hdet-grad-sync",
        choices=("global", "arm"),
        default=_DEFAULT.grad_sync,
        help="'global': all-reduce grads over all DP every step (paper); 'arm': only "
        "inside an arm during fan-out",
    )
    g.add_argument(
        "--hdet-axis",
        action="append",
        default=None,
        metavar="NAME:SPREAD[:MIN:MAX]",
        help="explored hyperparameter (repeatable): lr, lr:<group>, weight_decay, "
        "dropout, attention_temperature; default: lr with the measured spread (0.3 with auto-LR "
        "on a line signal, else 1/9)",
    )
    g.add_argument(
        "--hdet-spread",
        type=number(),
        default=None,
        help="spread of the LR axis (shorthand when no --hdet-axis is given; default: 0.3 "
        "with auto-LR on a line signal, else 1/9)",
    )
    g.add_argument(
        "--hdet-spread-kind",
        choices=("linear", "log"),
        default="linear",
        help="linear (paper) or log-symmetric multipliers for multiplicative axes",
    )
    g.add_argument(
        "--hdet-auto",
        dest="hdet_auto",
        action="store_true",
        default=_DEFAULT.auto,
        help="run the auto controller (default)",
    )
    g.add_argument(
        "--no-hdet-auto",
        dest="hdet_auto",
        action="store_false",
        help="fan-out and converge only; the base schedule is never moved",
    )
    g.add_argument(
        "--hdet-auto-start",
        type=integer(),
        default=_DEFAULT.auto_start,
        help="iterations before the controller may move",
    )
    g.add_argument(
        "--hdet-temperature",
        type=_temperature,
        default=_DEFAULT.temperature,
        help="softmax temperature sigma over arm losses, or 'auto'",
    )
    g.add_argument(
        "--hdet-meta-lr", type=number(), default=None, help="lambda (default: 1.0 with newton, else 0.5)"
    )
    g.add_argument(
        "--hdet-momentum", type=number(), default=None, help="beta (default: 0.5 with newton, else 0.9)"
    )
    g.add_argument(
        "--hdet-scale-bounds",
        type=number(),
        nargs=2,
        default=list(_DEFAULT.scale_bounds),
        metavar=("MIN", "MAX"),
        help="clamp of the learned scale",
    )
    g.add_argument(
        "--hdet-rule",
        choices=("auto", "relative", "paper", "newton"),
        default=_DEFAULT.rule,
        help="controller update: 'auto' (default: newton with a line signal, else relative), "
        "'relative' (softmax), 'paper' (the paper's absolute rule) or 'newton' (step to the "
        "minimum of a quadratic fitted over the arms; >= 3 arms)",
    )
    g.add_argument(
        "--hdet-seed", type=integer(), default=_DEFAULT.seed, help="seed of the per-window permutations"
    )
    g.add_argument(
        "--hdet-bucket-mb",
        type=number(),
        default=_DEFAULT.bucket_mb,
        help="converge all-reduce bucket size in MiB",
    )
    g.add_argument(
        "--no-hdet-home-main-params",
        dest="hdet_home_main_params",
        action="store_false",
        default=_DEFAULT.home_main_params,
        help="copy main params in and out of the converge buckets at every converge "
        "instead of keeping them in the buckets (in-place converge, default)",
    )
    g.add_argument(
        "--hdet-converge-on-save",
        dest="hdet_converge_on_save",
        action="store_true",
        default=_DEFAULT.converge_on_save,
        help="converge before saving (default)",
    )
    g.add_argument("--no-hdet-converge-on-save", dest="hdet_converge_on_save", action="store_false")
    g.add_argument("--hdet-nonfinite", choices=("exclude", "raise"), default=_DEFAULT.nonfinite)
    g.add_argument(
        "--hdet-rollback",
        action="store_true",
        default=_DEFAULT.rollback,
        help="when every arm is non-finite, restore the last converged state",
    )
    g.add_argument(
        "--hdet-signal",
        choices=("auto", "train", "probe", "line", "average"),
        default=_DEFAULT.signal,
        help="what the controller compares: 'auto' (default: 'average' when the loop has a "
        "probe and >= 3 arms, else 'train'), 'train' (window training loss per arm, "
        "paper), 'probe' (each arm's loss on one shared unseen batch at the "
        "window's end: removes the arms' data noise; one forward per window) or "
        "'line' (every replica evaluates the window's update line at each arm's "
        "multiplier on its own unseen batch, slope corrected for the short-horizon "
        "bias; one forward per arm per window; >= 3 arms, one lr axis) or "
        "'average' (the same through the arms' window-averaged iterates)",
    )
    g.add_argument(
        "--hdet-start-scale",
        type=number(),
        default=None,
        help="slow start: the LR scale the controller starts at (default: 0.25 with auto-LR "
        "on a line signal, else 1)",
    )
    g.add_argument(
        "--hdet-line-width",
        type=number(),
        default=None,
        help="line signals: score the window's line at evenly spaced multipliers over 1 +- W "
        "instead of at the arms' own (default); e.g. --hdet-spread 0.05 --hdet-line-width 0.3",
    )
    g.add_argument(
        "--hdet-brake",
        dest="hdet_brake",
        action="store_true",
        default=_DEFAULT.brake,
        help="cut the LR scale at the first sign of instability (default)",
    )
    g.add_argument("--no-hdet-brake", dest="hdet_brake", action="store_false")
    g.add_argument(
        "--hdet-brake-factor", type=number(), default=_DEFAULT.brake_factor, help="brake cut factor"
    )
    g.add_argument(
        "--hdet-brake-spike",
        type=number(),
        default=_DEFAULT.brake_spike,
        help="an arm's loss this fraction above the arms' median brakes",
    )
    g.add_argument(
        "--hdet-brake-rise",
        type=number(),
        default=_DEFAULT.brake_rise,
        help="the high arms' loss rising this fraction over a window brakes",
    )
    g.add_argument(
        "--hdet-brake-hold",
        type=integer(),
        default=_DEFAULT.brake_hold,
        help="windows after a brake without a rise of the scale",
    )
    g.add_argument(
        "--hdet-noise-aware",
        dest="hdet_noise_aware",
        action="store_true",
        default=_DEFAULT.noise_aware,
        help="shrink each line-signal step by its confidence (default)",
    )
    g.add_argument("--no-hdet-noise-aware", dest="hdet_noise_aware", action="store_false")
    g.add_argument(
        "--hdet-warmup-hold",
        dest="hdet_warmup_hold",
        action="store_true",
        default=_DEFAULT.warmup_hold,
        help="no rise of the LR scale while the base schedule warms up (default)",
    )
    g.add_argument("--no-hdet-warmup-hold", dest="hdet_warmup_hold", action="store_false")
    return parser


#: HDETConfig field -> the ``--hdet-*`` flag that sets it (error messages name the flag).
HDET_FLAGS: dict[str, str] = {
    "period": "--hdet-period",
    "arms": "--hdet-arms",
    "grad_sync": "--hdet-grad-sync",
    "axes": "--hdet-axis",
    "auto_start": "--hdet-auto-start",
    "temperature": "--hdet-temperature",
    "meta_lr": "--hdet-meta-lr",
    "momentum": "--hdet-momentum",
    "scale_bounds": "--hdet-scale-bounds",
    "rule": "--hdet-rule",
    "seed": "--hdet-seed",
    "bucket_mb": "--hdet-bucket-mb",
    "nonfinite": "--hdet-nonfinite",
    "signal": "--hdet-signal",
    "start_scale": "--hdet-start-scale",
    "line_width": "--hdet-line-width",
    "brake_factor": "--hdet-brake-factor",
    "brake_spike": "--hdet-brake-spike",
    "brake_rise": "--hdet-brake-rise",
    "brake_hold": "--hdet-brake-hold",
}

_FIELD = re.compile(r"^(?:HDETConfig\.(?P<field>\w+)=|Axis\b)")


def name_the_flag(message: str, flags: Mapping[str, str] = HDET_FLAGS) -> str:
    """Prefix an :class:`HDETConfigError` message with the command-line flag of its field.

    ``"HDETConfig.period=0: must be ..."`` -> ``"--hdet-period: HDETConfig.period=0: must be ..."``;
    ``Axis(...)`` messages get the axis flag (``flags["axes"]``). Messages that already start
    with a flag, or whose field has no flag, are returned unchanged.
    """
    match = _FIELD.match(message)
    if not match:
        return message
    flag = flags.get(match.group("field") or "axes")
    return f"{flag}: {message}" if flag else message


def hdet_config_from_args(args: argparse.Namespace) -> HDETConfig | None:
    """The :class:`HDETConfig` the flags describe, or None with ``--no-hdet``.

    Raises :class:`HDETConfigError` (naming the flag and the field) for bad values.
    """
    if not getattr(args, "hdet", True):
        return None
    if args.hdet_axis and args.hdet_spread is not None:
        raise HDETConfigError(
            "--hdet-spread and --hdet-axis conflict: give the LR spread inside --hdet-axis lr:SPREAD"
        )
    flags = dict(HDET_FLAGS)
    try:
        if args.hdet_axis:
            parsed = []
            for text in args.hdet_axis:
                flags["axes"] = f"--hdet-axis {text}"
                parsed.append(parse_axis(text))
            axes = tuple(parsed)
            flags["axes"] = "--hdet-axis"
        elif args.hdet_spread is not None:
            flags["axes"] = "--hdet-spread"
            axes = (Axis("lr", args.hdet_spread),)
        elif args.hdet_spread_kind != "linear":
            axes = (Axis("lr", PAPER_SPREAD),)
        else:
            axes = None  # the measured default, chosen when the run starts
        if axes is not None and args.hdet_spread_kind != "linear":
            axes = tuple(a if a.additive else replace(a, kind=args.hdet_spread_kind) for a in axes)
        return _config(args, axes)
    except HDETConfigError as exc:
        raise HDETConfigError(name_the_flag(str(exc), flags)) from None


def _config(args: argparse.Namespace, axes: tuple[Axis, ...] | None) -> HDETConfig:
    return HDETConfig(
        period=args.hdet_period,
        arms=args.hdet_arms,
        grad_sync=args.hdet_grad_sync,
        axes=axes,
        auto=args.hdet_auto,
        auto_start=args.hdet_auto_start,
        temperature=args.hdet_temperature,
        meta_lr=args.hdet_meta_lr,
        momentum=args.hdet_momentum,
        scale_bounds=tuple(args.hdet_scale_bounds),
        rule=args.hdet_rule,
        seed=args.hdet_seed,
        bucket_mb=args.hdet_bucket_mb,
        home_main_params=getattr(args, "hdet_home_main_params", _DEFAULT.home_main_params),
        converge_on_save=args.hdet_converge_on_save,
        nonfinite=args.hdet_nonfinite,
        rollback=args.hdet_rollback,
        signal=args.hdet_signal,
        start_scale=getattr(args, "hdet_start_scale", None),
        brake=getattr(args, "hdet_brake", _DEFAULT.brake),
        brake_factor=getattr(args, "hdet_brake_factor", _DEFAULT.brake_factor),
        brake_spike=getattr(args, "hdet_brake_spike", _DEFAULT.brake_spike),
        brake_rise=getattr(args, "hdet_brake_rise", _DEFAULT.brake_rise),
        brake_hold=getattr(args, "hdet_brake_hold", _DEFAULT.brake_hold),
        noise_aware=getattr(args, "hdet_noise_aware", _DEFAULT.noise_aware),
        warmup_hold=getattr(args, "hdet_warmup_hold", _DEFAULT.warmup_hold),
        line_width=getattr(args, "hdet_line_width", None),
    )
