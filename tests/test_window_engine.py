"""The window engine (hdet_megatron.window): one window path for every runtime.

The runtime pairs: the same windows through Megatron-Core's ``HDET`` and through
``HDETOneCycleLR`` give the same ``ControllerUpdate``, line fit and averaged params, bit for bit
(tests/window_pair_worker.py says how the windows are made the same). And the startup notice.
"""

from __future__ import annotations

import pytest

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.window import startup_notice
from tests.harness import run_world
from tests.window_pair_worker import PairRun, pair_world


@pytest.mark.slow
def test_torch_and_megatron_runtimes_make_the_same_window_updates():
    runs = [
        PairRun(signal="average"),
        PairRun(signal="line"),
        PairRun(signal="probe"),
        PairRun(signal="train"),
        # Every arm non-finite in window 1 with rollback: the same restore and the same cut.
        PairRun(signal="average", config={"rollback": True}, nan_window=None, all_nan_window=1),
        # A narrow spread with a wide line: arms at 0.95..1.05, the line scored at 0.7..1.3.
        PairRun(signal="average", config={"axes": (Axis("lr", 0.05),), "line_width": 0.3}),
    ]
    results = run_world(4, pair_world, runs, timeout=300)
    for i, run in enumerate(runs):
        per_rank = [r[i] for r in results]
        for r in per_rank:
            assert len(r["megatron"]) == run.windows
            # The same update and line fit from both runtimes, window by window.
            assert r["megatron"] == r["torch"], (run.signal, r["megatron"], r["torch"])
            # The same average: the converged params agree between the runtimes...
            assert all(m == t for m, t in r["digests"]), r["digests"]
        # ...and across the replicas (every rank decided alike).
        assert len({str(r["megatron"]) for r in per_rank}) == 1
        assert len({tuple(r["digests"]) for r in per_rank}) == 1
        windows = per_rank[0]["megatron"]
        updates = [w["update"] for w in windows if w["update"] is not None]
        if run.all_nan_window is not None:
            rolled = windows[run.all_nan_window]
            assert rolled["rolled_back"] and rolled["update"] is None
            before = windows[run.all_nan_window - 1]["scales"]["lr"]
            assert rolled["scales"]["lr"] == before * 0.5  # cut by brake_factor
        if run.nan_window is not None:
            assert updates[run.nan_window]["excluded"] == [1]
            assert [u["excluded"] for i, u in enumerate(updates) if i != run.nan_window] == [[]] * 2
        # Not a vacuous agreement: the controller moved, and the line signals fitted lines.
        assert any(u["moved"] and u["deltas"]["lr"] != 0.0 for u in updates), updates
        lines = [w["line"] for w in windows if not w["rolled_back"]]
        assert all(line is not None for line in lines) == (run.signal in ("line", "average"))
        if "line_width" in run.config:  # scored wider than the arms train
            assert all(line["points"] == pytest.approx([0.7, 0.9, 1.1, 1.3], abs=1e-12) for line in lines)


def test_the_startup_notice_says_the_slow_start_and_how_to_switch_it_off():
    slow = HDETConfig(period=10).resolve(probe_available=True, num_arms=4)
    line, warn = startup_notice(slow.config, slow.note)
    assert warn and "slow start at 0.25x the given LR; that is 4x below the given LR, climbing" in line
    assert "--hdet-start-scale 1" in line and "--no-hdet-auto" in line and "\n" not in line
    assert line.startswith("HDET auto-LR defaults: signal 'average'")
    # A config the caller resolved itself (no note): the settings are still named.
    line, warn = startup_notice(slow.config)
    assert warn and line.startswith("HDET auto-LR: signal 'average', rule 'newton', lr spread 0.3;")
    wide = HDETConfig(period=10, axes=(Axis("lr", 0.05),), line_width=0.3).resolve(True, 4).config
    said = "HDET auto-LR: signal 'average', rule 'newton', lr spread 0.05, line scored at 1 +- 0.3;"
    assert startup_notice(wide)[0].startswith(said)
    assert "the LR starts 4x below the given LR (start_scale 0.25), climbing" in line
    # At the given LR: information, not a warning; auto off with a probe: the probe is idle.
    at_lr = HDETConfig(period=10, start_scale=1.0).resolve(True, 4)
    line, warn = startup_notice(at_lr.config, at_lr.note)
    assert not warn and "starts" not in line
    off = HDETConfig(period=10, auto=False).resolve(True, 4)
    idle = "the probe is not run (nothing would read it)"
    assert startup_notice(off.config) == (f"HDET auto-LR is off: {idle}", False)
    assert startup_notice(off.config, probe_given=False) == ("", False)
    # The spread it chose is named (not the signal or rule: they never run).
    said = "HDET defaults (auto-LR off): LR spread 0.111"
    assert startup_notice(off.config, off.note, probe_given=False) == (said, False)
    assert startup_notice(off.config, off.note) == (f"{said}; {idle}", False)
    # Auto-LR without a probe: the paper's train signal, said as a warning.
    bare = HDETConfig(period=10).resolve(False, 4)
    line, warn = startup_notice(bare.config, bare.note, probe_given=False)
    assert warn and "no probe_fn was given" in line


def test_show_notices_prints_them_as_the_programs_own_lines(capsys):
    import logging

    from hdet_megatron import window

    log = logging.getLogger(window.__name__)
    saved = (list(log.handlers), log.level, log.propagate)
    try:
        window.show_notices("[one]")
        window.show_notices("[pretrain_gpt]")  # again: replaces, does not add
        log.info("HDET auto-LR defaults: rule 'relative'")
        assert capsys.readouterr().out == "[pretrain_gpt] HDET auto-LR defaults: rule 'relative'\n"
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
