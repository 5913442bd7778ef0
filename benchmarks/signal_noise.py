"""How the train signal's signal/noise per window grows with the tokens each arm sees per window.

    .venv/bin/python benchmarks/signal_noise.py RUN_DIR [RUN_DIR ...] [--tokens-per-arm-window N]

Reads the ``window`` records of HDET runs of the example (``metrics.jsonl``; a fixed scale, i.e.
``--no-hdet-auto``, keeps the LR axis clean) and measures, for blocks of k = 1, 2, 4, 8 consecutive
windows, how well the arms' window training losses (``arm_train_losses``, each on its own data)
separate the LR multipliers: every window's losses and multipliers are centred on their window
means, the centred losses of one multiplier are averaged over the block (k times the tokens per
arm: what a k times larger batch per arm would see, to first order), and the least-squares slope
of loss on multiplier across the spread is the signal, the residual std the noise. If the noise
is the arms' data, it falls as 1/sqrt(k) and signal/noise grows as sqrt(k): the formula used to
extrapolate to GPT-scale batches is

    SNR(tokens per arm per window) = SNR_measured * sqrt(tokens / tokens_measured)

with tokens per arm per window = global batch tokens / arms * T.
"""

from __future__ import annotations

import argparse
import json
import math
import os


def windows(run_dir: str) -> list[tuple[list[float], list[float]]]:
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "window" and "lr" in rec.get("arm_values", {}):
                out.append((rec["arm_values"]["lr"], rec.get("arm_train_losses") or rec["arm_losses"]))
    return out


def snr(blocks: list[list[tuple[list[float], list[float]]]]) -> dict:
    xs, ys = [], []
    for block in blocks:
        per_mult: dict[float, list[float]] = {}
        for mults, losses in block:
            mm, ml = sum(mults) / len(mults), sum(losses) / len(losses)
            for m, v in zip(mults, losses, strict=True):
                per_mult.setdefault(round(m - mm, 9), []).append(v - ml)
        for m, vs in per_mult.items():
            xs.append(m)
            ys.append(sum(vs) / len(vs))
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    resid = [y - slope * x for x, y in zip(xs, ys, strict=True)]
    noise = math.sqrt(sum(r * r for r in resid) / (len(resid) - 1))
    spread = max(xs) - min(xs)
    return {"points": len(xs), "signal": slope * spread, "noise": noise, "snr": abs(slope) * spread / noise}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument(
        "--tokens-per-arm-window",
        type=float,
        default=2 * 128 * 20,
        help="tokens one arm trains on per window in these runs (default: the quality "
        "benchmark's micro batch 2 x seq 128 x T 20 = 5120)",
    )
    p.add_argument("--skip", type=int, default=5, help="leading windows left out (fast early phase)")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    print(
        f"{'run':<28} {'k':>2} {'tokens/arm/window':>17} {'signal':>8} {'noise':>8} {'SNR':>6} "
        f"{'sqrt(k) x SNR(1)':>16}"
    )
    for run in args.runs:
        ws = windows(run)[args.skip :]
        base = None
        for k in args.blocks:
            blocks = [ws[i : i + k] for i in range(0, len(ws) - k + 1, k)]
            if len(blocks) < 3:
                continue
            r = snr(blocks)
            base = r["snr"] if k == 1 else base
            print(
                f"{os.path.basename(run.rstrip('/')):<28} {k:>2} {k * args.tokens_per_arm_window:>17,.0f} "
                f"{r['signal']:>+8.4f} {r['noise']:>8.4f} {r['snr']:>6.2f} "
                f"{(base or 0) * math.sqrt(k):>16.2f}"
            )


if __name__ == "__main__":
    main()
