"""What the auto-LR probes cost: their share of the training time, measured inside one run.

Runs the GPT example (4 ranks, the quality benchmark's model) with the default auto-LR (the
``average`` line signal: one forward pass of this rank's local batch per point of the update line,
4 points per window with 4 arms) at converge period T, and divides the probes' host time
(``probe_seconds`` of every ``window`` record of metrics.jsonl) by the run's training time
(``train_seconds`` of its ``final`` record). Both are measured in the same processes, so the
ratio holds on a shared machine better than a comparison of two runs would.

    .venv/bin/python benchmarks/probe_cost.py --period 100 --steps 300 --global-batch 64 --micro-batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quality import add_model_flags, default_data_prefix, model_args, run_one  # noqa: E402


def probe_share(run_dir: str) -> tuple[float, float, int]:
    """``(probe seconds, training seconds, windows)`` of a finished run."""
    probe, train, windows = 0.0, None, 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "window":
                probe += record.get("probe_seconds", 0.0)
                windows += 1
            elif record.get("type") == "final":
                train = record["train_seconds"]
    if train is None:
        raise SystemExit(f"{run_dir}: the run did not finish")
    return probe, train, windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p, steps=300)
    p.add_argument("--period", type=int, default=100, help="converge period T")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="benchmarks/results/probe_cost")
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    flags = model_args(args, default_data_prefix(), args.seed)
    flags += ["--lr", f"{args.lr:g}", "--min-lr", f"{args.lr / 10:g}", "--hdet-period", str(args.period)]
    name = f"average-T{args.period}"
    run_one(name, flags, args.out, args.force, print)
    probe, train, windows = probe_share(os.path.join(args.out, name))
    print(
        f"T={args.period}: {windows} windows, probes {probe:.2f} s of {train:.1f} s training = "
        f"{100 * probe / train:.2f}% ({probe / max(windows, 1):.2f} s per window)"
    )


if __name__ == "__main__":
    main()
