"""Figures for BENCHMARKS.md from the benchmarks' JSON results.

    .venv/bin/python benchmarks/plots.py --results benchmarks/results --out benchmarks/figures

Reads whichever of ``converge.json``, ``scale_sim.json`` and ``quality/quality.json`` exist and
writes ``converge.png``, ``scale_sim.png``, ``quality_sweep.png`` and ``quality_lr.png``.

    .venv/bin/python benchmarks/plots.py --controller RUN_DIR [RUN_DIR ...] --out DIR --name NAME

draws one HDET run's auto-LR controller per window instead (``NAME.png``; a run of the example
or of ``benchmarks/generalize.py``): the line's slope ``g`` (raw and short-horizon corrected) and
curvature ``q``; the newton rule's raw step with its jackknife se, the applied step and the
branch it took; the confidence; the LR scale.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _save(fig, out: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_converge(data: dict, out: str) -> str:
    rows = data["rows"]
    names = [r["method"] for r in rows]
    ratios = [r["ratio_to_limit"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    colors = [
        "tab:blue" if n.startswith("homed") else "tab:green" if n.startswith("bucketed") else "tab:gray"
        for n in names
    ]
    ax.barh(names, ratios, color=colors)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(1.1, color="tab:red", lw=0.8, ls="--", label="target 1.10x")
    for i, r in enumerate(rows):
        ax.text(
            ratios[i], i, f" {ratios[i]:.2f}x  +{r['peak_rss_extra_mib']:.0f} MiB", va="center", fontsize=8
        )
    ax.set_xlabel("median time / flat all-reduce of the same bytes (lower is better)")
    ax.set_title(
        f"Converge of {data['params'] / 1e6:.1f}M fp32 params, {data['ranks']} gloo ranks, "
        f"{data['reps']} rounds"
    )
    ax.invert_yaxis()
    ax.set_xlim(0, max(ratios) * 1.35)
    ax.legend(loc="lower right", fontsize=8)
    path = _save(fig, out, "converge.png")
    return path


def plot_scale(rows: list, out: str) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    series = defaultdict(list)
    for r in rows:
        series[(r.get("grad_sync", "global"), r["replicas_per_arm"], r["period"])].append(r)
    colors = {}
    for (sync, per_arm, period), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["replicas"])
        color = colors.setdefault(period, f"C{len(colors)}")
        ax = axes[0] if per_arm == 1 else axes[1]
        ax.plot(
            [r["replicas"] for r in rs],
            [r["error_octaves"] for r in rs],
            "-o" if sync == "global" else "--s",
            color=color,
            label=f"T={period}, grad_sync={sync}",
        )
        if per_arm == 1 and sync == "global":
            axes[2].plot(
                [r["replicas"] for r in rs],
                [r["converge_bytes_per_step"] / 1e6 for r in rs],
                "-o",
                color=color,
                label=f"T={period}",
            )
    for ax, title in ((axes[0], "one arm per replica"), (axes[1], "hierarchical: 8 replicas per arm")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas N")
        ax.set_ylabel("|log2(final LR / optimum)| (octaves)")
        ax.set_title(f"Controller error (NQM, 4x too low), {title}", fontsize=9)
        ax.legend(fontsize=6)
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("replicas N")
    axes[2].set_ylabel("converge MB per step per rank (2 GB model)")
    axes[2].set_title("Converge traffic, ring all-reduce cost model", fontsize=9)
    axes[2].legend(fontsize=7)
    path = _save(fig, out, "scale_sim.png")
    return path


#: HDET run groups of quality.py: marker and label.
QUALITY_GROUPS = {
    "spread": ("s", "spread only (0.3), best LR"),
    "spread-small": ("P", "spread only (1/9), best LR"),
    "auto-best": ("^", "auto, from best LR"),
    "auto-low": (">", "auto, from best/4"),
    "auto-high": ("<", "auto, from 4x best"),
    "paper-low": ("x", "paper rule, from best/4"),
    "paper-high": ("+", "paper rule, from 4x best"),
    "arm-low": ("D", "grad_sync=arm, from best/4"),
    "probe-best": ("v", "auto + probe signal, from best LR"),
    "probe-low": ("*", "auto + probe signal, from best/4"),
    "probe-high": ("h", "auto + probe signal, from 4x best"),
}


def _mean_and_range(values: list[float]) -> tuple[float, float, float]:
    m = sum(values) / len(values)
    return m, m - min(values), max(values) - m


def plot_quality(data: dict, out: str) -> list[str]:
    """Validation loss vs LR (sweep mean over seeds with min..max bars; HDET groups at the final
    base LR, same bars) and the base-LR trajectories of the HDET runs (one line per seed)."""
    runs = data["runs"]
    seeds = sorted({r["seed"] for r in runs})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_lr = defaultdict(list)
    for r in runs:
        if r["group"] == "sweep":
            by_lr[r["lr"]].append(r["valid_loss"])
    lrs = sorted(by_lr)
    stats = [_mean_and_range(by_lr[lr]) for lr in lrs]
    ax.errorbar(
        lrs,
        [m for m, _, _ in stats],
        yerr=[[lo for _, lo, _ in stats], [hi for _, _, hi in stats]],
        fmt="-o",
        color="k",
        capsize=3,
        label=f"plain Megatron sweep (mean of {len(seeds)} seeds)",
    )
    for group, (marker, label) in QUALITY_GROUPS.items():
        rs = [r for r in runs if r["group"] == group]
        if not rs:
            continue
        m, lo, hi = _mean_and_range([r["valid_loss"] for r in rs])
        x = math.exp(sum(math.log(r["effective_lr"]) for r in rs) / len(rs))
        ax.errorbar([x], [m], yerr=[[lo], [hi]], fmt=marker, ms=8, capsize=3, label=f"HDET {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("peak LR (HDET: final base LR = lr x c, geometric mean over seeds)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Quality on the default corpus: validation loss vs LR")
    ax.legend(fontsize=7)
    paths = [_save(fig, out, "quality_sweep.png")]

    starts = (("low", "from best/4"), ("best", "from the best LR"), ("high", "from 4x best"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    best = {}
    for seed in seeds:
        sweep = [r for r in runs if r["group"] == "sweep" and r["seed"] == seed]
        if sweep:
            best[seed] = min(sweep, key=lambda r: r["valid_loss"])["lr"]
    for ax, (start, title) in zip(axes, starts, strict=True):
        for i, group in enumerate(g for g in QUALITY_GROUPS if g.endswith(start)):
            for r in (r for r in runs if r["group"] == group and r["lr_trajectory"]):
                its = [0] + [t[0] for t in r["lr_trajectory"]]
                ys = [r["lr"] / best.get(r["seed"], r["lr"])] + [
                    t[1] / best.get(r["seed"], r["lr"]) for t in r["lr_trajectory"]
                ]
                ax.step(
                    its,
                    ys,
                    where="post",
                    color=f"C{i}",
                    alpha=0.8,
                    label=QUALITY_GROUPS[group][1] if r["seed"] == seeds[0] else None,
                )
        ax.axhline(1.0, color="k", ls="--", lw=0.8, label="best sweep LR")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("iteration")
        ax.set_title(f"auto-LR {title} (one line per seed)", fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("base peak LR (lr x c) / best sweep LR")
    paths.append(_save(fig, out, "quality_lr.png"))
    return paths


def plot_controller(run_dirs: list[str], out: str, name: str) -> str:
    """Per window of each run (one column per run): what the controller saw and did."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from generalize import controller_trace

    fig, axes = plt.subplots(4, len(run_dirs), figsize=(5.2 * len(run_dirs), 10), sharex="col", squeeze=False)
    markers = {"min": "o", "clip+": "^", "clip-": "v", "edge+": ">", "edge-": "<"}
    for col, run_dir in enumerate(run_dirs):
        trace = controller_trace(run_dir)
        if not trace:
            raise SystemExit(f"{run_dir}: no window records with a controller update")
        it = [t["iteration"] for t in trace]
        ax = axes[0][col]
        ax.plot(it, [t["g"] for t in trace], "C0.-", label="g (slope at s=1)")
        ax.plot(it, [t["g_corrected"] for t in trace], "C1.--", label="g corrected (horizon)")
        ax.plot(it, [t["q"] for t in trace], "C2.-", label="q (curvature)")
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(os.path.basename(os.path.normpath(run_dir)), fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        raw = [t["raw_step"] for t in trace]
        ax.errorbar(
            it, raw, yerr=[t["step_se"] for t in trace], fmt="none", ecolor="C0", alpha=0.5, capsize=2
        )
        for branch, marker in markers.items():
            pts = [(t["iteration"], t["raw_step"]) for t in trace if t["branch"] == branch]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker, color="C0", ls="none", label=f"raw step ({branch})")
        ax.plot(it, [t["step"] for t in trace], "C3x", label="applied (x confidence)")
        ax.axhline(0, color="k", lw=0.6)
        for y in (math.log(2), -math.log(2)):
            ax.axhline(y, color="gray", ls=":", lw=0.8)
        ax.set_ylabel("log target factor")
        ax.legend(fontsize=7)
        ax = axes[2][col]
        ax.plot(it, [t["confidence"] for t in trace], "C4.-")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel("confidence d^2/(d^2+se^2)")
        ax = axes[3][col]
        ax.step(it, [t["scale"] for t in trace], where="post", color="C5", marker=".")
        for t in trace:
            if t["brake"]:
                ax.axvline(t["iteration"], color="tab:red", lw=0.8)
        ax.set_yscale("log", base=2)
        ax.set_ylabel("LR scale c after the update (red: brake)")
        ax.set_xlabel("iteration")
    return _save(fig, out, f"{name}.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--out", default="benchmarks/figures")
    p.add_argument("--controller", nargs="+", default=None, help="HDET run dirs: per-window controller plot")
    p.add_argument("--name", default="controller", help="--controller: the figure's file name (no .png)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.controller:
        print(f"wrote {plot_controller(args.controller, args.out, args.name)}")
        return
    written = []
    converge = _load(os.path.join(args.results, "converge.json"))
    if converge:
        written.append(plot_converge(converge, args.out))
    scale = _load(os.path.join(args.results, "scale_sim.json"))
    if scale:
        written.append(plot_scale(scale, args.out))
    quality = _load(os.path.join(args.results, "quality", "quality.json"))
    if quality:
        written.extend(plot_quality(quality, args.out))
    for path in written:
        print(f"wrote {path}")
    if not written:
        raise SystemExit(f"no results in {args.results}")


if __name__ == "__main__":
    main()
