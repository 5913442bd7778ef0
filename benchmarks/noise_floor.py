r"""How far a task's final loss moves when the LR barely does: the floor under issue 35's "+1%".

    .venv/bin/python benchmarks/noise_floor.py --best onecycle-ddp:1234:2e-3:2.2108 \
        --best onecycle-ddp:1235:4e-3:2.1658
    .venv/bin/python benchmarks/noise_floor.py --table-only

``generalize.py`` compares every row with the best point of the same seed's 5-point LR sweep. A
row whose trajectory differs from that point's in any way (another LR, another schedule, arms)
is a fresh draw of the task's run-to-run variation, and so, at the same expected loss, lands
above or below the best point by that variation. This script measures it: plain runs (the
sweep's own command line) at the best sweep LR times ``--factors`` (default 0.98 and 1.02). The
sweeps change the loss by 2-30% per factor of 2 around their best points, so 2% of LR moves the
expected loss by far less than 0.1%: what the rows differ by is the variation, not the LR.

``--best TASK:SEED:LR:LOSS``: the seed's best sweep LR and its validation loss, from an earlier
``generalize.py`` run (BENCHMARKS.md lists them); the plain run at LR itself is that point.
Results: ``noise_floor.json`` and the table ``noise_floor.md`` under ``--out``; each run's
directory as ``generalize.py`` writes it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generalize  # noqa: E402  (the tasks and their command lines)
import quality  # noqa: E402

FACTORS = (0.98, 1.02)


def parse_best(text: str) -> tuple[str, int, float, float]:
    """``TASK:SEED:LR:LOSS`` -> (task, seed, lr, loss), with named errors."""
    parts = text.split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"--best {text!r}: expected TASK:SEED:LR:LOSS")
    task, seed, lr, loss = parts
    if task not in generalize.TASKS:
        known = sorted(generalize.TASKS)
        raise argparse.ArgumentTypeError(f"--best {text!r}: unknown task {task!r}; known: {known}")
    try:
        return task, int(seed), float(lr), float(loss)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--best {text!r}: {e}") from None


def gaps(rows: list[dict]) -> list[float]:
    """The rows' gaps to their seed's best sweep point, in %."""
    return [100.0 * (r["valid_loss"] / r["best_loss"] - 1.0) for r in rows]


def table(rows: list[dict]) -> str:
    """Per task: every draw's gap to its seed's best point and the standard deviation of the
    draws (best point included) pooled over the seeds, in % of the best point."""
    out = [
        "| task | role | seed: gaps of the draws at LR x " + "/".join(f"{f:g}" for f in FACTORS) + " | "
        "SD of a draw (pooled, % of best) | mean gap of the draws |",
        "|---|---|---|---:|---:|",
    ]
    for name, task in generalize.TASKS.items():
        trows = [r for r in rows if r["task"] == name]
        if not trows:
            continue
        per_seed, ss, dof = [], 0.0, 0
        for seed in sorted({r["seed"] for r in trows}):
            srows = sorted((r for r in trows if r["seed"] == seed), key=lambda r: r["factor"])
            draws = [0.0, *gaps(srows)]  # the best point itself is a draw at factor 1
            mean = math.fsum(draws) / len(draws)
            ss += math.fsum((d - mean) ** 2 for d in draws)
            dof += len(draws) - 1
            per_seed.append(f"{seed}: " + ", ".join(f"{g:+.2f}" for g in gaps(srows)))
        sd = math.sqrt(ss / dof) if dof else math.nan
        all_gaps = gaps(trows)
        out.append(
            f"| `{name}` | {task.role} | {'; '.join(per_seed)} | {sd:.2f} | "
            f"{math.fsum(all_gaps) / len(all_gaps):+.2f}% |"
        )
    return "\n".join(out)


def save(path: str, row: dict) -> None:
    """Add ``row`` to the results file (read again under a lock: two runners may share it)."""
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = load(path)
        rows[(row["task"], row["seed"], row["factor"])] = row
        with open(path + ".tmp", "w") as f:
            runs = sorted(rows.values(), key=lambda r: (r["task"], r["seed"], r["factor"]))
            json.dump({"runs": runs}, f, indent=1)
        os.replace(path + ".tmp", path)


def load(path: str) -> dict[tuple[str, int, float], dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(r["task"], r["seed"], r["factor"]): r for r in json.load(f)["runs"]}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--best", type=parse_best, action="append", default=[], metavar="TASK:SEED:LR:LOSS")
    p.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    p.add_argument("--eval-iters", type=int, default=20, help="Megatron tasks' validation batches")
    p.add_argument("--out", default="benchmarks/results/noise_floor")
    p.add_argument("--force", action="store_true", help="rerun finished runs")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    if not args.best and not args.table_only:
        p.error("give at least one --best TASK:SEED:LR:LOSS (or --table-only)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "noise_floor.json")
    data_prefix = None if args.table_only else quality.default_data_prefix()

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    for name, seed, best_lr, best_loss in args.best:
        task = generalize.TASKS[name]
        for factor in args.factors:
            run = generalize.Run(f"noise-x{factor:g}", "sweep", best_lr * factor, None)
            run_dir = os.path.join(args.out, name, f"{run.row}-s{seed}")
            cmd = generalize.command(task, run, seed, data_prefix or "", args.eval_iters)
            final, seconds = generalize.execute(cmd, run_dir, args.force, log)
            loss = final["valid_loss"]
            row = {
                "task": name,
                "seed": seed,
                "factor": factor,
                "lr": run.lr,
                "best_lr": best_lr,
                "best_loss": best_loss,
                "valid_loss": loss if isinstance(loss, (int, float)) and math.isfinite(loss) else math.inf,
                "wall_seconds": seconds,
                "run_dir": run_dir,
            }
            save(path, row)
            log(
                f"{name} seed {seed} x{factor:g}: valid {loss:.4f} ({gaps([row])[0]:+.2f}% vs the best point)"
            )
    text = table(list(load(path).values()))
    with open(os.path.join(args.out, "noise_floor.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
