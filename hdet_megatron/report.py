"""``hdet report RUN_DIR``: a PNG and a short text summary of a training run's ``metrics.jsonl``.

The figure (2 x 2):

1. training loss per step: each arm (before any DP reduction, smoothed) and the mean over
   replicas; window means per arm as dots at each converge;
2. learning rate: the base schedule, base x controller scale (the arms' centre), the band
   spanned by the arms' LRs, and the controller's LR scale (right axis);
3. validation loss (averaged model at converge points; each arm's model otherwise), test loss;
4. per window: each arm's window loss minus the window mean, coloured by the arm's LR
   multiplier (which side of the spread won), with the softmax-weighted multiplier.

Pure module: reads JSONL, needs matplotlib (dev extra) for the PNG only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from hdet_megatron.metrics import METRICS_FILE, as_float, read_metrics
from hdet_megatron.preflight import InputError
from hdet_megatron.run_dirs import REPORT_PNG_KEY, check_report_output


class ReportError(ValueError):
    """A run directory ``hdet report`` cannot read (one line for the user, no traceback)."""


@dataclass
class Run:
    """One run's metrics records, by kind, in file order."""

    run_dir: str
    runs: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)
    valid: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    finals: list[dict] = field(default_factory=list)

    @property
    def info(self) -> dict:
        return self.runs[-1] if self.runs else {}

    @property
    def num_arms(self) -> int:
        for s in self.steps:
            if s.get("arm_losses"):
                return len(s["arm_losses"])
        return int(self.info.get("arms") or 1)

    @property
    def hdet(self) -> dict | None:
        return self.info.get("hdet")


def _dedupe(records: list[dict], key=lambda r: r.get("iteration")) -> list[dict]:
    """Last record per key wins (a resumed run re-writes the iterations after its checkpoint)."""
    out: dict = {}
    for r in records:
        out[key(r)] = r
    return sorted(out.values(), key=lambda r: r.get("iteration") or 0)


def load_run(run_dir: str) -> Run:
    """Read ``RUN_DIR/metrics.jsonl`` (or that file) into a :class:`Run`; :class:`ReportError` if unusable."""
    hint = f"is {run_dir!r} the --run-dir (or --save) of a pretrain_gpt.py run?"
    if not os.path.exists(run_dir):
        raise ReportError(f"no {METRICS_FILE} in {run_dir} (no such directory); {hint}")
    path = os.path.join(run_dir, METRICS_FILE) if os.path.isdir(run_dir) else run_dir
    try:
        records = read_metrics(run_dir)
    except FileNotFoundError as exc:
        raise ReportError(f"{exc}; {hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path} is unreadable ({getattr(exc, 'strerror', None) or exc}); {hint}") from None
    if not records:
        raise ReportError(f"{path} is empty (no complete record); {hint}")
    records = [r for r in records if isinstance(r, dict) and isinstance(r.get("type"), str)]
    if not records:
        raise ReportError(f"{path} holds no HDET metrics records (another program's file?); {hint}")
    run = Run(run_dir=run_dir)
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r)
    run.runs = by_type.get("run", [])
    run.steps = _dedupe(by_type.get("step", []))
    run.windows = _dedupe(by_type.get("window", []), key=lambda r: (r.get("window"), r.get("iteration")))
    run.valid = _dedupe(by_type.get("valid", []))
    run.test = _dedupe(by_type.get("test", []))
    run.checkpoints = _dedupe(by_type.get("checkpoint", []))
    run.finals = by_type.get("final", [])
    if not run.steps:
        raise ReportError(f"{run_dir}: no training steps recorded yet")
    return run


# --- text summary ------------------------------------------------------------------------------


def _mean(values) -> float:
    vals = [v for v in (as_float(x) for x in values) if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def summary(run: Run) -> str:
    """The text summary ``hdet report`` prints: model, data, HDET, losses, throughput."""
    info, lines = run.info, []
    args = info.get("args", {})
    hdet = run.hdet
    lines.append(f"run {os.path.abspath(run.run_dir)} ({len(run.runs)} launch(es))")
    if info:
        lines.append(
            f"model {info.get('num_params', 0) / 1e6:.2f}M params, {args.get('num_layers')} layers x "
            f"{args.get('hidden_size')} hidden, seq {args.get('seq_length')} | "
            f"TP{info.get('tp')} PP{info.get('pp')} DP{info.get('dp')} (world {info.get('world')}) | "
            f"data: {(info.get('data') or {}).get('description', '?')}"
        )
    if hdet:
        axes = ", ".join(f"{a['name']}:{a['spread']:.3g}" for a in hdet.get("axes", []))
        lines.append(
            f"HDET {run.num_arms} arms, period {hdet.get('period')}, axes {axes}, "
            f"grad_sync {hdet.get('grad_sync')}, auto {hdet.get('auto')}"
        )
    else:
        lines.append("HDET off (plain Megatron)")
    first, last = run.steps[0], run.steps[-1]
    k = max(1, min(10, len(run.steps) // 5))
    lines.append(
        f"iterations {first['iteration']}..{last['iteration']}: train loss "
        f"{_mean(s.get('loss') for s in run.steps[:k]):.4f} (first {k}) -> "
        f"{_mean(s.get('loss') for s in run.steps[-k:]):.4f} (last {k})"
    )
    if run.valid:
        best = min(run.valid, key=lambda r: as_float(r.get("loss")) or float("inf"))
        lines.append(
            f"validation loss {as_float(run.valid[0]['loss']):.4f} @ {run.valid[0]['iteration']} -> "
            f"{as_float(run.valid[-1]['loss']):.4f} @ {run.valid[-1]['iteration']} "
            f"(best {as_float(best['loss']):.4f} @ {best['iteration']})"
        )
    if run.test:
        lines.append(f"test loss {as_float(run.test[-1]['loss']):.4f} @ {run.test[-1]['iteration']}")
    if run.windows:
        lr_scales = (as_float((w.get("scales") or {}).get("lr")) for w in run.windows)
        scales = [s for s in lr_scales if s is not None]
        conv_s = sum(as_float(w.get("converge_seconds")) or 0.0 for w in run.windows)
        conv_b = _mean(w.get("converge_bytes") for w in run.windows)
        if scales:
            start = as_float(run.steps[0].get("scale"))
            start = 1.0 if start is None else start
            lines.append(
                f"controller lr scale {start:.4f} -> {scales[-1]:.4f} "
                f"(range {min(scales):.4f}..{max(scales):.4f})"
            )
        train_s = sum(as_float(f.get("train_seconds")) or 0.0 for f in run.finals)
        share = f", {100 * conv_s / train_s:.2f}% of train time" if train_s > 0 else ""
        lines.append(
            f"{len(run.windows)} converges: {conv_s:.3f} s total{share}, "
            f"{conv_b / 1e6:.2f} MB all-reduced per rank each"
        )
        per_step = _mean(w.get("converge_bytes_per_step") for w in run.windows)
        grad = _mean(w.get("grad_bytes_per_step") for w in run.windows)
        if per_step is not None and math.isfinite(per_step):
            traffic = f"converge traffic {per_step / 1e6:.3f} MB per rank per step"
            if grad is not None and math.isfinite(grad) and grad > 0:
                traffic += (
                    f", DP gradient sync {grad / 1e6:.2f} MB per rank per step "
                    f"(converge = {100 * per_step / grad:.2f}% of it)"
                )
            lines.append(traffic)
        wins = _lr_wins(run)
        if wins:
            lines.append(
                f"lowest window loss: higher-LR arm {wins[0]}x, lower-LR arm {wins[1]}x, "
                f"of {wins[2]} windows with a spread"
            )
    if run.finals:
        f = run.finals[-1]
        lines.append(
            f"throughput {as_float(f.get('tokens_per_s')) or 0:,.0f} tokens/s, "
            f"wall {as_float(f.get('wall_seconds')) or 0:.0f} s (last launch)"
        )
    if run.checkpoints:
        lines.append(f"checkpoint {run.checkpoints[-1].get('path')}")
    return "\n".join(lines)


def _lr_wins(run: Run) -> tuple[int, int, int] | None:
    higher = lower = total = 0
    for w in run.windows:
        mult = (w.get("arm_values") or {}).get("lr")
        losses = [as_float(x) for x in w.get("arm_losses") or []]
        if not mult or len(mult) < 2 or any(x is None or not math.isfinite(x) for x in losses):
            continue
        if max(mult) == min(mult):
            continue
        total += 1
        finite = [x for x in losses if x is not None]  # all of them (checked above)
        best = min(range(len(finite)), key=finite.__getitem__)
        mid = sum(mult) / len(mult)
        if mult[best] > mid:
            higher += 1
        elif mult[best] < mid:
            lower += 1
    return (higher, lower, total) if total else None


# --- the figure --------------------------------------------------------------------------------


def _ema(values: Sequence[float | None], span: int) -> list[float | None]:
    if span <= 1:
        return list(values)
    alpha, acc = 2.0 / (span + 1), None
    out: list[float | None] = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(float("nan"))
            continue
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot(run: Run, output: str, smooth: int | None = None) -> str:
    """Draw the run's curves into the PNG ``output`` (needs matplotlib); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError(
            "the PNG needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')"
        ) from None

    steps = run.steps
    its = [s["iteration"] for s in steps]
    arms = run.num_arms
    span = smooth if smooth is not None else max(1, len(steps) // 40)
    colors = plt.get_cmap("viridis")([0.15 + 0.7 * a / max(arms - 1, 1) for a in range(arms)])
    fig, axs = plt.subplots(2, 2, figsize=(13, 8.5))
    info = run.info
    title = f"HDET GPT pretraining: {os.path.basename(os.path.abspath(run.run_dir))}"
    if info:
        title += (
            f"  |  {info.get('num_params', 0) / 1e6:.2f}M params, TP{info.get('tp')} PP{info.get('pp')} "
            f"DP{info.get('dp')}, {arms} arm{'s' if arms > 1 else ''}"
        )
        if run.hdet:
            title += f", T={run.hdet.get('period')}"
    fig.suptitle(title, fontsize=12)

    # 1. training loss
    ax = axs[0, 0]
    if steps[0].get("arm_losses"):
        for a in range(arms):
            vals = [as_float((s.get("arm_losses") or [None] * arms)[a]) for s in steps]
            ax.plot(
                its,
                _ema([v if v is not None else float("nan") for v in vals], span),
                color=colors[a],
                lw=1.0,
                alpha=0.85,
                label=f"arm {a}",
            )
    ax.plot(
        its,
        _ema([as_float(s.get("loss")) for s in steps], span),
        color="black",
        lw=1.6,
        label="mean over replicas",
    )
    for w in run.windows:
        for a, v in enumerate(w.get("arm_losses") or []):
            v = as_float(v)
            if v is not None and math.isfinite(v):
                centre = w["iteration"] - (w.get("steps") or 1) / 2 + 0.5
                ax.plot(centre, v, "o", ms=3.5, color=colors[a % len(colors)])
    ax.set_title(f"training loss (EMA {span}); dots: arm's window mean")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    _clip_loss_axis(ax, [as_float(s.get("loss")) for s in steps])
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)

    # 2. learning rate
    ax = axs[0, 1]
    base = [as_float(s.get("base_lr")) for s in steps]
    centre = [as_float(s.get("lr")) for s in steps]
    # Each step's arm LRs that are numbers (a record holds numbers; as_float gives None otherwise).
    arm_lrs = [[v for v in (as_float(x) for x in (s.get("arm_lrs") or [])) if v is not None] for s in steps]
    if arm_lrs and all(arm_lrs) and arms > 1:
        lo = [min(x) for x in arm_lrs]
        hi = [max(x) for x in arm_lrs]
        ax.fill_between(its, lo, hi, color="tab:blue", alpha=0.2, lw=0, label="arms' LR band")
    ax.plot(its, base, color="grey", ls="--", lw=1.2, label="base schedule")
    ax.plot(its, centre, color="tab:blue", lw=1.6, label="base x scale")
    ax.set_title("learning rate")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    scale = [as_float(s.get("scale")) for s in steps]
    if run.hdet and any(v is not None for v in scale):
        ax2 = ax.twinx()
        ax2.plot(its, scale, color="tab:red", lw=1.2, label="controller scale c (right)")
        ax2.set_ylabel("scale c", color="tab:red")
        ax2.tick_params(axis="y", colors="tab:red")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    # Below the axes: the scale line can be anywhere inside.
    ax.legend(
        handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False
    )

    # 3. validation
    ax = axs[1, 0]
    if run.valid:
        vit = [r["iteration"] for r in run.valid]
        ax.plot(
            vit,
            [as_float(r["loss"]) for r in run.valid],
            color="black",
            lw=1.4,
            marker="s",
            ms=5,
            label="validation (mean over replicas)",
        )
        for r in run.valid:
            if not r.get("converged") and r.get("arm_losses"):
                for a, v in enumerate(r["arm_losses"]):
                    ax.plot(r["iteration"], as_float(v), "o", mfc="none", color=colors[a % len(colors)], ms=6)
        last = run.valid[-1]
        ax.annotate(
            f"{as_float(last['loss']):.3f}",
            (last["iteration"], as_float(last["loss"])),
            textcoords="offset points",
            xytext=(-10, 8),
            fontsize=9,
        )
    if run.test:
        t = run.test[-1]
        ax.plot(t["iteration"], as_float(t["loss"]), "*", color="tab:orange", ms=12, label="test")
    ax.set_title("held-out loss (squares: all replicas; rings: per arm)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    if run.valid or run.test:
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.text(
            0.5,
            0.5,
            "no validation recorded (--eval-iters 0)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )

    # 4. per-window arm advantage
    ax = axs[1, 1]
    plotted = False
    if run.windows:
        import matplotlib.colors as mcolors

        mults = [m for w in run.windows for m in ((w.get("arm_values") or {}).get("lr") or [])]
        norm = mcolors.Normalize(min(mults, default=0.9), max(mults, default=1.1))
        cmap = plt.get_cmap("coolwarm")
        for w in run.windows:
            losses = [as_float(x) for x in w.get("arm_losses") or []]
            mult = (w.get("arm_values") or {}).get("lr") or [1.0] * len(losses)
            finite = [x for x in losses if x is not None and math.isfinite(x)]
            if not finite:
                continue
            mean = sum(finite) / len(finite)
            for a, v in enumerate(losses):
                if v is not None and math.isfinite(v):
                    ax.scatter(w["iteration"], v - mean, color=cmap(norm(mult[a])), s=18, zorder=3)
                    plotted = True
        if plotted:
            sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
            fig.colorbar(sm, ax=ax, label="arm LR multiplier rho")
            ax.axhline(0, color="grey", lw=0.8)
    ax.set_title("arm's window loss minus window mean (< 0: better)")
    ax.set_xlabel("iteration (converge)")
    ax.set_ylabel("loss difference")
    ax.grid(alpha=0.3)
    if not plotted:
        ax.text(
            0.5, 0.5, "no HDET windows (plain Megatron run)", ha="center", va="center", transform=ax.transAxes
        )

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    # The text chunk marks the PNG as ours: a later report may replace it, nothing else.
    fig.savefig(output, dpi=110, metadata={REPORT_PNG_KEY: "hdet_megatron.report"})
    plt.close(fig)
    return output


def _clip_loss_axis(ax, losses: list) -> None:
    """Keep the start-of-training spike from flattening the rest of the curve."""
    vals = sorted(v for v in losses if v is not None and math.isfinite(v))
    if len(vals) < 10:
        return
    lo, hi = vals[0], vals[int(0.98 * (len(vals) - 1))]
    top = min(vals[-1], hi + 0.5 * (hi - lo))
    ax.set_ylim(lo - 0.05 * (top - lo), top + 0.05 * (top - lo))


def report(
    run_dir: str, output: str | None = None, make_plot: bool = True, smooth: int | None = None
) -> tuple[str, str | None]:
    """Summary text and PNG path (``RUN_DIR/report.png`` unless ``output``). Refuses
    (:class:`ReportError`) to overwrite a file that ``hdet report`` did not write."""
    run = load_run(run_dir)
    text = summary(run)
    png = None
    if make_plot:
        output = output or os.path.join(run_dir, "report.png")
        try:
            check_report_output(output)  # never overwrite a file hdet report did not write
        except InputError as exc:
            raise ReportError(str(exc)) from None
        png = plot(run, output, smooth=smooth)
    return text, png
