"""Quality: HDET against a plain-Megatron LR sweep, on the example and its default corpus.

    .venv/bin/python benchmarks/quality.py --out benchmarks/results/quality          # everything
    .venv/bin/python benchmarks/quality.py --phase sweep                             # sweep only
    .venv/bin/python benchmarks/quality.py --phase hdet --seeds 1 2 3                # HDET runs

Every run is ``examples/pretrain_gpt/pretrain_gpt.py`` under ``torchrun`` on 4 local gloo ranks
(DP4: 4 data-parallel replicas = 4 HDET arms), the same model, data, seed and token budget; only
the LR and the HDET flags differ. Runs:

- ``sweep-x{1/4..4}``: plain Megatron (``--no-hdet``) at 5 LRs, ``center * 2**k``, k = -2..2;
- ``spread``: HDET, spread only (``--no-hdet-auto``) at the sweep's best LR; ``spread-small``
  the same with the paper's spread 1/9 instead of the benchmark's 0.3;
- ``auto-best`` / ``auto-low`` / ``auto-high``: HDET + auto controller from the best LR, from
  4x too low and from 4x too high;
- ``paper-low`` / ``paper-high``: the same with the paper's absolute update rule;
- ``arm-low``: ``--hdet-grad-sync arm`` from 4x too low (next to ``auto-low``, global sync);
- ``probe-best`` / ``probe-low`` / ``probe-high``: the auto runs with ``--hdet-signal probe``
  (arms compared on one shared unseen batch at each window's end instead of their own data);
- ``line-best`` / ``line-low`` / ``line-high``: ``--hdet-signal line --hdet-rule newton`` (the
  update line evaluated by every replica on its own unseen batch, horizon-corrected).

The HDET phase takes the best LR from the finished sweep of the same seed (or ``--best-lr``).
A finished run (its ``final`` record present) is not run again, so an interrupted benchmark
continues where it stopped; ``--force`` reruns. Results: ``quality.json`` (one row per run:
final validation loss, the base LR trajectory ``lr * scale`` per window, compute in rank-seconds)
and a text table; ``benchmarks/plots.py`` draws the figures.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt", "pretrain_gpt.py")
PREPARE = os.path.join(ROOT, "examples", "pretrain_gpt", "prepare_data.py")
NPROC = 4

#: Sweep points as powers of two around the centre LR (x1/4 .. x4).
SWEEP_EXPONENTS = (-2, -1, 0, 1, 2)


def add_model_flags(p: argparse.ArgumentParser, steps: int) -> None:
    """The flags ``model_args`` reads (model, batch, schedule length, evaluation)."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument(
        "--global-batch",
        type=int,
        default=8,
        help="sequences per iteration over all 4 ranks (the 8x-batch rows use 64)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=2,
        help="sequences per rank per forward (global batch / 4 / micro = accumulation)",
    )
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--eval-iters", type=int, default=20)


def default_data_prefix() -> str:
    """The embedded default corpus, prepared (cached) by the example's ``prepare_data.py``."""
    return (
        subprocess.run(
            [sys.executable, PREPARE, "--default-corpus", "--print-prefix"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )


def model_args(args: argparse.Namespace, data_prefix: str, seed: int) -> list[str]:
    """Flags shared by every run: model, data, schedule shape, evaluation."""
    return [
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--num-layers",
        str(args.layers),
        "--hidden-size",
        str(args.hidden),
        "--num-attention-heads",
        str(args.heads),
        "--seq-length",
        str(args.seq),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--micro-batch-size",
        str(args.micro_batch),
        "--global-batch-size",
        str(args.global_batch),
        "--train-iters",
        str(args.steps),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        str(args.warmup),
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--seed",
        str(seed),
        "--data-path",
        data_prefix,
        "--split",
        "90,5,5",
        "--eval-interval",
        str(args.steps),
        "--eval-iters",
        str(args.eval_iters),
        "--log-interval",
        str(args.steps),
        "--quiet",
        "--no-tensorboard",
    ]


def hdet_args(
    args: argparse.Namespace,
    auto: bool,
    rule: str = "relative",
    grad_sync: str = "global",
    spread: float | None = None,
    signal: str = "train",
    meta_lr: float | None = None,
    auto_start: int = 0,
) -> list[str]:
    """HDET flags of the benchmark (one setting for every HDET run, see BENCHMARKS.md)."""
    flags = [
        "--hdet-period",
        str(args.period),
        "--hdet-spread",
        f"{args.spread if spread is None else spread:.6g}",
        "--hdet-temperature",
        args.temperature,
        "--hdet-meta-lr",
        str(args.meta_lr if meta_lr is None else meta_lr),
        "--hdet-momentum",
        str(args.momentum),
        "--hdet-rule",
        rule,
        "--hdet-grad-sync",
        grad_sync,
        "--hdet-signal",
        signal,
        "--hdet-auto-start",
        str(auto_start),
    ]
    return flags + ([] if auto else ["--no-hdet-auto"])


def lr_flags(lr: float) -> list[str]:
    # min LR is a fixed fraction of the peak so every run has the same schedule shape.
    return ["--lr", f"{lr:.6g}", "--min-lr", f"{lr / 10:.6g}"]


def read_run(run_dir: str) -> dict | None:
    """The run's final record, validation losses and per-window base LR, or None if unfinished."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    final, run, windows, valid = None, None, [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            kind = rec.get("type")
            if kind == "final":
                final = rec
            elif kind == "run":
                run = rec
            elif kind == "window":
                windows.append(
                    {
                        "iteration": rec["iteration"],
                        "base_lr": rec["base_lr"],
                        "scale": rec["scales"].get("lr", 1.0),
                        "arm_losses": rec["arm_losses"],
                    }
                )
            elif kind == "valid":
                valid.append({"iteration": rec["iteration"], "loss": rec["loss"]})
    if final is None or run is None:
        return None
    return {"final": final, "run": run, "windows": windows, "valid": valid}


def run_one(name: str, flags: list[str], out: str, force: bool, log) -> dict:
    run_dir = os.path.join(out, name)
    done = None if force else read_run(run_dir)
    if done is not None:
        log(f"[{name}] already finished: valid loss {done['final']['valid_loss']:.4f} (skipped)")
        return done
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        f"--nproc-per-node={NPROC}",
        SCRIPT,
        *flags,
        "--run-dir",
        run_dir,
    ]
    os.makedirs(run_dir, exist_ok=True)
    # A stale metrics.jsonl of an unfinished run would be appended to: start clean.
    for stale in ("metrics.jsonl",):
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    log(f"[{name}] start: {' '.join(shlex.quote(c) for c in cmd[3:])}")
    start = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    done = read_run(run_dir)
    if proc.returncode != 0 or done is None:
        raise SystemExit(f"[{name}] failed (exit {proc.returncode}); see {run_dir}/stdout.log")
    log(f"[{name}] valid loss {done['final']['valid_loss']:.4f}  ({seconds:.0f} s)")
    return done


def summarize(name: str, group: str, lr: float, seed: int, res: dict) -> dict:
    final = res["final"]
    windows = res["windows"]
    final_scale = final.get("scales", {}).get("lr", 1.0) if final.get("scales") else 1.0
    return {
        "name": name,
        "group": group,
        "seed": seed,
        "lr": lr,
        "valid_loss": final["valid_loss"],
        "train_loss": final["train_loss"],
        "test_loss": final.get("test_loss"),
        "final_scale": final_scale,
        "effective_lr": lr * final_scale,
        # Compute: every run uses NPROC ranks for its training time.
        "rank_seconds": final["train_seconds"] * NPROC,
        "train_seconds": final["train_seconds"],
        "tokens_per_s": final["tokens_per_s"],
        "lr_trajectory": [(w["iteration"], lr * w["scale"]) for w in windows],
        "valid_curve": [(v["iteration"], v["loss"]) for v in res["valid"]],
        "hdet": res["run"].get("hdet"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--phase", choices=("sweep", "hdet", "all"), default="all")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument("--center-lr", type=float, default=2e-3, help="sweep centre (x1)")
    p.add_argument(
        "--sweep-exponents",
        type=int,
        nargs="+",
        default=list(SWEEP_EXPONENTS),
        help="sweep points k (lr = centre * 2**k) to start from (default -2..2)",
    )
    p.add_argument(
        "--best-lr",
        type=float,
        default=None,
        help="LR of the HDET runs' 'best' (default: best sweep point of the same seed)",
    )
    p.add_argument("--only", nargs="+", default=None, help="run only these HDET run names")
    add_model_flags(p, steps=400)
    p.add_argument("--period", type=int, default=20, help="HDET converge period T")
    p.add_argument("--spread", type=float, default=0.3)
    p.add_argument("--temperature", default="auto")
    p.add_argument("--meta-lr", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--out", default="benchmarks/results/quality")
    p.add_argument("--force", action="store_true", help="rerun finished runs")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "quality.log"), "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    data_prefix = default_data_prefix()
    results_path = os.path.join(args.out, "quality.json")
    rows = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            rows = {(r["name"], r["seed"]): r for r in json.load(f)["runs"]}

    def record(row: dict) -> None:
        rows[(row["name"], row["seed"])] = row
        with open(results_path, "w") as f:
            json.dump(
                {
                    "settings": vars(args),
                    "runs": sorted(rows.values(), key=lambda r: (r["seed"], r["group"], r["name"])),
                },
                f,
                indent=1,
            )

    center_k = None
    for seed in args.seeds:
        base = model_args(args, data_prefix, seed)
        # The sweep must bracket its best point: start with x1/4..x4 around the centre and,
        # while the best LR has fewer than two points on either side, add the missing ones
        # (every point a power of two of --center-lr, so runs are shared between seeds' sweeps).
        sweep: dict[int, float] = {}  # exponent k (lr = center * 2**k) -> valid loss
        wanted = set(args.sweep_exponents) if center_k is None else set(range(center_k - 2, center_k + 3))
        if args.phase == "hdet" and args.best_lr is not None:
            wanted = set()  # HDET runs only, around a given best LR: the sweep may run elsewhere
        while wanted:
            for k in sorted(wanted - set(sweep)):
                lr = args.center_lr * 2.0**k
                name = f"sweep-x{2.0**k:g}-s{seed}"
                if args.phase in ("sweep", "all"):
                    res = run_one(name, base + lr_flags(lr) + ["--no-hdet"], args.out, args.force, log)
                else:
                    res = read_run(os.path.join(args.out, name))
                if res is None:
                    raise SystemExit(
                        f"seed {seed}: sweep run {name} is unfinished; run --phase "
                        "sweep first or give --best-lr"
                    )
                loss = res["final"]["valid_loss"]
                sweep[k] = loss if math.isfinite(loss) else math.inf  # a diverged run loses
                record(summarize(name, "sweep", lr, seed, res))
            best_k = min(sweep, key=sweep.get)
            center_k = best_k  # the next seed starts its sweep around this seed's best
            missing = set(range(best_k - 2, best_k + 3)) - set(sweep)
            if not missing or args.best_lr is not None:
                break
            log(
                f"seed {seed}: best sweep LR x{2.0**best_k:g} lacks neighbours "
                f"{sorted(2.0**k for k in missing)}: extending the sweep"
            )
            wanted |= missing
        if args.phase == "sweep":
            continue
        best = args.best_lr if args.best_lr is not None else args.center_lr * 2.0**center_k
        log(f"seed {seed}: best LR {best:g}")
        plan = [
            ("spread", best, hdet_args(args, auto=False)),
            ("spread-small", best, hdet_args(args, auto=False, spread=1 / 9)),
            ("auto-best", best, hdet_args(args, auto=True)),
            ("auto-low", best / 4, hdet_args(args, auto=True)),
            ("auto-high", best * 4, hdet_args(args, auto=True)),
            ("paper-low", best / 4, hdet_args(args, auto=True, rule="paper")),
            ("paper-high", best * 4, hdet_args(args, auto=True, rule="paper")),
            ("arm-low", best / 4, hdet_args(args, auto=True, grad_sync="arm")),
            ("probe-best", best, hdet_args(args, auto=True, signal="probe")),
            ("probe-low", best / 4, hdet_args(args, auto=True, signal="probe")),
            ("probe-high", best * 4, hdet_args(args, auto=True, signal="probe")),
            # The horizon-corrected line signal with the newton rule (meta LR 1: the step
            # follows the fitted curve, see docs and hdet_megatron/line_signal.py).
            ("line-best", best, hdet_args(args, auto=True, signal="line", rule="newton", meta_lr=1.0)),
            ("line-low", best / 4, hdet_args(args, auto=True, signal="line", rule="newton", meta_lr=1.0)),
            ("line-high", best * 4, hdet_args(args, auto=True, signal="line", rule="newton", meta_lr=1.0)),
            ("avg-best", best, hdet_args(args, auto=True, signal="average", rule="newton", meta_lr=1.0)),
            ("avg-low", best / 4, hdet_args(args, auto=True, signal="average", rule="newton", meta_lr=1.0)),
            ("avg-high", best * 4, hdet_args(args, auto=True, signal="average", rule="newton", meta_lr=1.0)),
            # "average" with the controller held for the first 100 iterations (5 windows): early
            # windows reward any step size (fast initial progress) and pushed the LR up.
            (
                "avgs-best",
                best,
                hdet_args(args, auto=True, signal="average", rule="newton", meta_lr=1.0, auto_start=100),
            ),
            (
                "avgs-low",
                best / 4,
                hdet_args(args, auto=True, signal="average", rule="newton", meta_lr=1.0, auto_start=100),
            ),
            (
                "avgs-high",
                best * 4,
                hdet_args(args, auto=True, signal="average", rule="newton", meta_lr=1.0, auto_start=100),
            ),
            # Measurement only: the line signal logged at a fixed scale (controller off).
            ("linefix-low", best / 4, hdet_args(args, auto=False, signal="line", rule="newton")),
            ("linefix-best", best, hdet_args(args, auto=False, signal="line", rule="newton")),
            ("linefix-high", best * 4, hdet_args(args, auto=False, signal="line", rule="newton")),
        ]
        # Issue 25: auto-LR with nothing but the period given (every other HDET field at its
        # default: signal average + newton with the example's probe, slow start, brake,
        # noise-aware steps), from guesses 1/16..16x the best LR, next to plain Megatron at the
        # same guess (x1/4..x4 are sweep points).
        guesses = {"x0.0625": 1 / 16, "x0.25": 1 / 4, "x1": 1.0, "x4": 4.0, "x16": 16.0}
        for tag, factor in guesses.items():
            plan.append((f"def-{tag}", best * factor, ["--hdet-period", str(args.period)]))
            # The guards off (start at the guess, no brake, no noise-aware shrink): what each adds.
            plan.append(
                (
                    f"noguard-{tag}",
                    best * factor,
                    [
                        "--hdet-period",
                        str(args.period),
                        "--hdet-start-scale",
                        "1",
                        "--no-hdet-brake",
                        "--no-hdet-noise-aware",
                    ],
                )
            )
        for tag in ("x0.0625", "x16"):
            plan.append((f"plain-{tag}", best * guesses[tag], ["--no-hdet"]))
        # A 2-D baseline: plain Megatron over peak LR x warm-up length (100 iterations instead
        # of --warmup), so the comparison is with a 2-D hand search, not only a 1-D sweep.
        for factor in (1.0, 2.0, 4.0):
            plan.append((f"warm100-x{factor:g}", best * factor, ["--no-hdet", "--lr-warmup-iters", "100"]))
        for name, lr, flags in plan:
            if args.only and name not in args.only:
                continue
            res = run_one(f"{name}-s{seed}", base + lr_flags(lr) + flags, args.out, args.force, log)
            record(summarize(f"{name}-s{seed}", name, lr, seed, res))

    print_table(list(rows.values()), log)
    with open(os.path.join(args.out, "quality.md"), "w") as f:
        f.write(markdown_table(list(rows.values())) + "\n")
    spread_runs = [r["name"] for r in rows.values() if r["group"] == "spread"]
    snr = signal_to_noise(args.out, spread_runs)
    if snr:
        log(
            f"controller signal (spread-only runs, {snr['points']} arm-windows): window loss vs "
            f"LR multiplier slope {snr['slope_loss_per_multiplier']:+.4f}/unit, i.e. "
            f"{snr['signal_across_spread']:+.4f} from the lowest to the highest arm; residual "
            f"std {snr['residual_std']:.4f} -> signal/noise {snr['snr_per_window']:.2f} per window"
        )
        with open(results_path) as f:
            payload = json.load(f)
        payload["signal_to_noise"] = snr
        with open(results_path, "w") as f:
            json.dump(payload, f, indent=1)


def signal_to_noise(out: str, names: list[str]) -> dict:
    """How much an arm's window loss says about its LR multiplier (the controller's signal).

    Over every window of the given runs: the arms' losses and multipliers minus their window
    means; the least-squares slope of loss on multiplier is the LR signal (loss per unit of
    multiplier), the residual std the noise (mostly: the arms train on different data).
    """
    xs, ys = [], []
    for name in names:
        res = read_run(os.path.join(out, name))
        if res is None:
            continue
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("type") != "window" or "lr" not in rec.get("arm_values", {}):
                    continue
                losses, mults = rec["arm_losses"], rec["arm_values"]["lr"]
                ml, mm = sum(losses) / len(losses), sum(mults) / len(mults)
                xs.extend(m - mm for m in mults)
                ys.extend(v - ml for v in losses)
    if len(xs) < 3:
        return {}
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    resid = [y - slope * x for x, y in zip(xs, ys, strict=True)]
    noise = math.sqrt(sum(r * r for r in resid) / (len(resid) - 1))
    spread = max(xs) - min(xs)
    return {
        "points": len(xs),
        "slope_loss_per_multiplier": slope,
        "residual_std": noise,
        "signal_across_spread": slope * spread,
        "snr_per_window": abs(slope) * spread / noise,
    }


def markdown_table(rows: list[dict]) -> str:
    """Per group, over seeds: validation loss, its gap to the same seed's best sweep point,
    final base LR relative to that seed's best LR, and compute."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["group"] == "sweep" and (
            r["seed"] not in best or r["valid_loss"] < best[r["seed"]]["valid_loss"]
        ):
            best[r["seed"]] = r
    groups: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["lr"]):
        key = r["group"] if r["group"] != "sweep" else f"sweep x{r['lr'] / best[r['seed']]['lr']:g}"
        groups.setdefault(key, []).append(r)
    lines = [
        "| run | seeds | start LR / best | final LR / best | valid loss (mean, min..max) "
        "| vs best sweep point (mean, min..max) | rank-s per run |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = [
        "spread",
        "spread-small",
        "auto-best",
        "probe-best",
        "line-best",
        "auto-low",
        "probe-low",
        "line-low",
        "paper-low",
        "arm-low",
        "auto-high",
        "probe-high",
        "line-high",
        "paper-high",
        "avg-best",
        "avg-low",
        "avg-high",
        "avgs-best",
        "avgs-low",
        "avgs-high",
    ]
    keys = sorted((k for k in groups if k.startswith("sweep")), key=lambda k: float(k[7:]))
    keys += [k for k in order if k in groups]
    for key in keys:
        rs = groups[key]
        rel = [100 * (r["valid_loss"] / best[r["seed"]]["valid_loss"] - 1) for r in rs]
        loss = [r["valid_loss"] for r in rs]
        start = [r["lr"] / best[r["seed"]]["lr"] for r in rs]
        final = [r["effective_lr"] / best[r["seed"]]["lr"] for r in rs]

        def geo(v):
            return math.exp(sum(math.log(x) for x in v) / len(v))

        lines.append(
            f"| {key} | {len(rs)} | {geo(start):.3g} | {geo(final):.3g} | "
            f"{sum(loss) / len(loss):.4f} ({min(loss):.4f}..{max(loss):.4f}) | "
            f"{sum(rel) / len(rel):+.2f}% ({min(rel):+.2f}..{max(rel):+.2f}) | "
            f"{sum(r['rank_seconds'] for r in rs) / len(rs):.0f} |"
        )
    return "\n".join(lines)


def print_table(rows: list[dict], log) -> None:
    log(f"{'run':<16} {'start LR':>9} {'final LR':>9} {'valid loss':>10} {'vs best sweep':>13} {'rank-s':>7}")
    best_by_seed: dict[int, float] = {}
    for r in rows:
        if r["group"] == "sweep":
            best_by_seed[r["seed"]] = min(best_by_seed.get(r["seed"], math.inf), r["valid_loss"])
    for r in sorted(rows, key=lambda r: (r["seed"], r["group"] != "sweep", r["name"])):
        best = best_by_seed.get(r["seed"])
        rel = f"{100 * (r['valid_loss'] / best - 1):+.2f}%" if best else "-"
        log(
            f"{r['name']:<16} {r['lr']:9.2e} {r['effective_lr']:9.2e} {r['valid_loss']:10.4f} "
            f"{rel:>13} {r['rank_seconds']:7.0f}"
        )


if __name__ == "__main__":
    main()
