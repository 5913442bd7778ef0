"""``signal="line"`` on a real Megatron-Core world (4 gloo ranks, DP4 = 4 arms)."""

from __future__ import annotations

import math

import pytest

from tests.harness import run_world
from tests.line_signal_worker import line_world

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(4, line_world, str(tmp_path_factory.mktemp("line")), timeout=600)


@pytest.mark.parametrize("signal", ["line", "average"])
def test_line_signals_on_megatron(world, signal):
    results = [r[signal] for r in world]
    ref = results[0]["reference"]
    windows = ref["history"]
    assert [w[0] for w in windows] == [3, 6, 9]
    # Identical on every rank: the controller's scales, the pseudo-losses and the line fits.
    for r in results[1:]:
        assert r["reference"]["history"] == windows
        assert r["reference"]["scales"] == ref["scales"]
    for _it, _scales, pseudo, line in windows:
        assert line is not None and len(line["points"]) == 4  # one point per arm multiplier
        assert line["points"] == sorted(line["points"]) and pseudo == line["pseudo_losses"]
        assert all(math.isfinite(x) for x in line["losses"])
    # "line" corrects the slope by the persistence base_lr(end) / base_lr(now), which grows to 1
    # at the end of the cosine decay; "average" is never corrected.
    kappas = [w[3]["persistence"] for w in windows]
    assert kappas[0] < kappas[1] < kappas[2] == 1.0 if signal == "line" else kappas == [1.0] * 3
    # The controller moved on the line's evidence: away from its (slow) start, by its own steps.
    start = results[0]["start_scale"]
    assert start == 0.25 and ref["scales"]["lr"] != start
    assert [w[1]["lr"] for w in windows][0] != start
    # The line's point losses are the mean over all 4 replicas of what each evaluated (its own
    # batch at each of the 4 points, in order), i.e. the same data for every point.
    for w, (_it, _scales, _pseudo, line) in enumerate(windows):
        for k, value in enumerate(line["losses"]):
            local = [r["probe_losses"][4 * w + k] for r in results]
            assert math.isclose(value, sum(local) / 4, rel_tol=1e-6)  # float32 microbatch means
    # No host sync on non-converge steps; the converge reads its one small reduction.
    for r in results:
        assert [n for conv, n in r["syncs"] if not conv] == [0] * 6
        assert all(n >= 1 for conv, n in r["syncs"] if conv)
    # Checkpoint at iteration 6 and resume in fresh objects: bit-identical from there on.
    for r in results:
        got, want = r["resumed"], r["reference"]
        assert got["losses"] == {s: v for s, v in want["losses"].items() if s > 6}
        assert got["params"] == want["params"] and got["scales"] == want["scales"]
        assert got["history"] == [h for h in want["history"] if h[0] > 6]
    # With the controller off the line is not probed, and training is the train signal's.
    for r, plain in zip(results, world, strict=True):
        assert r["off_probes"] == 0
        assert r["off"]["params"] == plain["train_off"]["params"]
        assert r["off"]["losses"] == plain["train_off"]["losses"]
    # The two signals see different points (end points vs window averages).
    if signal == "average":
        other = world[0]["line"]["reference"]["history"][0][3]["losses"]
        assert windows[0][3]["losses"] != other
