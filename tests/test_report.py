"""`hdet report RUN_DIR`: summary and PNG from metrics.jsonl (synthetic runs; fast)."""

from __future__ import annotations

import json
import math

import pytest

from hdet_megatron.cli import main as hdet_main
from hdet_megatron.metrics import MetricsWriter, read_metrics
from hdet_megatron.report import ReportError, load_run, report


def _write_run(run_dir, hdet=True, steps=40, period=10, resumed_at=None):
    w = MetricsWriter(str(run_dir), tensorboard_dir=False)
    arms = 2 if hdet else 1
    w.write(
        {
            "type": "run",
            "iteration": 0,
            "args": {"num_layers": 2, "hidden_size": 32, "seq_length": 16},
            "tp": 2,
            "pp": 1,
            "dp": 2,
            "world": 4,
            "arms": arms,
            "num_params": 12345,
            "hdet": {
                "period": period,
                "axes": [{"name": "lr", "spread": 0.2}],
                "grad_sync": "global",
                "auto": True,
            }
            if hdet
            else None,
            "data": {"description": "synthetic"},
        }
    )
    scale = 1.0
    for it in range(1, steps + 1):
        loss = 5.0 * math.exp(-it / 15) + 1.0
        lrs = [1e-3 * scale * (1 + 0.2 * s) for s in ((-1, 1) if (it // period) % 2 else (1, -1))]
        w.write(
            {
                "type": "step",
                "iteration": it,
                "loss": loss,
                "arm_losses": [loss + 0.01, loss - 0.01] if hdet else None,
                "base_lr": 1e-3,
                "lr": 1e-3 * scale,
                "arm_lrs": lrs if hdet else [1e-3],
                "scale": scale,
                "tokens_per_s": 1000.0,
            }
        )
        if hdet and it % period == 0:
            scale *= 1.01
            w.write(
                {
                    "type": "window",
                    "iteration": it,
                    "window": it // period - 1,
                    "steps": period,
                    "arm_losses": [loss + 0.02, loss - 0.02],
                    "arm_values": {"lr": [0.8, 1.2]},
                    "arm_lrs": lrs,
                    "scales": {"lr": scale},
                    "converge_seconds": 0.01,
                    "converge_bytes": 1000,
                    "converge_bytes_per_step": 100.0,
                    "grad_bytes_per_step": 40000,
                    "forced": False,
                }
            )
        if it % 20 == 0:
            w.write(
                {
                    "type": "valid",
                    "iteration": it,
                    "loss": loss + 0.1,
                    "ppl": math.exp(loss + 0.1),
                    "arm_losses": [loss + 0.1] * arms,
                    "converged": True,
                }
            )
    w.write(
        {
            "type": "final",
            "iteration": steps,
            "train_seconds": 10.0,
            "wall_seconds": 20.0,
            "tokens_per_s": 1000.0,
        }
    )
    w.close()


def test_report_hdet_run(tmp_path):
    _write_run(tmp_path)
    text, png = report(str(tmp_path))
    assert "HDET 2 arms, period 10, axes lr:0.2" in text
    assert "validation loss" in text and "4 converges" in text and "0.40% of train time" in text
    assert "higher-LR arm 4x, lower-LR arm 0x, of 4 windows" in text
    assert "controller lr scale 1.0000 -> 1.0406" in text
    assert "converge traffic 0.000 MB per rank per step, DP gradient sync 0.04 MB" in text
    assert "(converge = 0.25% of it)" in text
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_plain_run_and_resumed_duplicates(tmp_path, capsys):
    _write_run(tmp_path, hdet=False, steps=30)
    # a resumed launch re-writes iterations 21..30: the last record of an iteration wins
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write(
            json.dumps(
                {
                    "type": "step",
                    "iteration": 30,
                    "loss": 0.5,
                    "base_lr": 1e-3,
                    "lr": 1e-3,
                    "arm_lrs": [1e-3],
                    "scale": 1.0,
                }
            )
            + "\n"
        )
        fh.write('{"type": "step", "itera')  # a run killed mid-write
    run = load_run(str(tmp_path))
    assert len(run.steps) == 30 and run.steps[-1]["loss"] == 0.5
    assert len(read_metrics(str(tmp_path))) > 30
    assert hdet_main(["report", str(tmp_path), "-o", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "HDET off" in out and "plot:" in out and (tmp_path / "r.png").stat().st_size > 10_000


def test_report_errors(tmp_path, capsys):
    assert hdet_main(["report", str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"type": "run"}) + "\n")
    with pytest.raises(ReportError, match="no training steps"):
        load_run(str(tmp_path))


def test_report_replaces_only_its_own_png(tmp_path, capsys):
    """A report.png that `hdet report` wrote is replaced by the next report; any other file at the
    output path (a user's own plot) is left alone: one error line, exit code 2 (issue 27)."""
    from hdet_megatron.run_dirs import is_hdet_report_png

    _write_run(tmp_path)
    _, png = report(str(tmp_path))
    assert is_hdet_report_png(png)
    _, again = report(str(tmp_path))  # its own PNG: replaced
    assert again == png and is_hdet_report_png(png)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    mine = tmp_path / "mine.png"
    fig.savefig(mine)  # a PNG of the user's: no hdet-report chunk
    plt.close(fig)
    assert not is_hdet_report_png(str(mine))
    for target, argv in (
        (tmp_path / "report.png", ["report", str(tmp_path)]),
        (mine, ["report", str(tmp_path), "-o", str(mine)]),
    ):
        if target.name == "report.png":
            target.write_bytes(mine.read_bytes())
        before = target.read_bytes()
        assert hdet_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "was not written by hdet report" in err and "-o PATH" in err
        assert target.read_bytes() == before
