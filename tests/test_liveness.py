"""hdet_megatron/liveness.py without torch: a peer process that is killed (gone) or frozen
(SIGSTOP: alive but silent, what NCCL would wait 10 minutes for) is reported within the
configured bound, once, naming its node and ranks; a stopped watcher reports nothing."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULE = REPO / "hdet_megatron" / "liveness.py"

# The peer: only the module file (no torch import), answering on a port until killed.
PEER = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("liveness", {str(MODULE)!r})
mod = importlib.util.module_from_spec(spec); sys.modules["liveness"] = mod; spec.loader.exec_module(mod)
live = mod.Liveness(60)
me = live.listen(rank=2, node=1, name="1", addr="127.0.0.1")
print(me.port, flush=True)
time.sleep(600)
"""


def _load():
    spec = importlib.util.spec_from_file_location("hdet_liveness_under_test", MODULE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


def _watcher(mod, port: int, timeout: float, interval: float):
    exits: list[tuple[float, int]] = []
    done = threading.Event()

    def fake_exit(code: int) -> None:
        exits.append((time.monotonic(), code))
        done.set()

    live = mod.Liveness(
        timeout, prog="test", interval=interval, exit=fake_exit, status=lambda: "at iteration 7"
    )
    me = live.listen(rank=0, node=0, name="0", addr="127.0.0.1")
    other = mod.Peer(rank=2, node=1, name="1", host="hostB", addr="127.0.0.1", port=port, pid=0)
    peers = [
        me,
        mod.Peer(1, 0, "0", me.host, "127.0.0.1", me.port, 0),
        other,
        mod.Peer(3, 1, "1", "hostB", "127.0.0.1", port, 0),
    ]
    return live, peers, exits, done


def test_frozen_node_is_reported_after_the_timeout(peer, capfd):
    mod = _load()
    proc, port = peer
    assert mod.probe("127.0.0.1", port, 1.0) == "ok"
    live, peers, exits, done = _watcher(mod, port, timeout=1.5, interval=0.25)
    live.start(peers)
    time.sleep(0.6)
    assert not exits  # answering: nothing happens
    os.kill(proc.pid, signal.SIGSTOP)  # the node hangs: its port still accepts, nobody answers
    frozen = time.monotonic()
    assert done.wait(15), "a frozen node was never reported"
    waited = exits[0][0] - frozen
    assert 1.5 - 0.3 <= waited <= 1.5 + 4.0, waited  # the configured bound, not 10 minutes
    assert exits == [(exits[0][0], mod.EXIT_NODE_LOST)]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("test: error: lost node 1 (host hostB, ranks 2,3): no answer for ")
    assert "at iteration 7; node 0 stops (heartbeat, --node-timeout 1.5 s)" in err[0]
    live.stop()


def test_gone_node_is_reported_within_two_pings_and_diagnosed(peer, capfd, monkeypatch):
    mod = _load()
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    proc, port = peer
    live, peers, exits, done = _watcher(mod, port, timeout=30, interval=0.3)
    # diagnose(): nothing is lost while the peer answers (the error is someone else's)
    live.peers = sorted(peers, key=lambda p: p.rank)
    assert live.diagnose(RuntimeError("boom")) is False
    proc.kill()
    proc.wait()
    assert mod.probe("127.0.0.1", port, 1.0) == "gone"
    # diagnose() after a failed collective: reported at once (rank 0 is its node's lowest rank)
    err_text = "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. This..."
    assert live.diagnose(RuntimeError(err_text)) is True
    line = capfd.readouterr().err.strip()
    assert line == (
        "test: error: lost node 1 (host hostB, ranks 2,3): its processes are gone "
        "(connection refused) at iteration 7; node 0 stops (a collective failed: "
        "Connection closed by peer [127.0.0.1]:1). Relaunch every node to resume "
        "from the last checkpoint"
    )
    # the heartbeat thread of another watcher: two refused pings, well before the 30 s timeout
    live2, peers2, exits2, done2 = _watcher(mod, port, timeout=30, interval=0.3)
    start = time.monotonic()
    live2.start(peers2)
    assert done2.wait(10)
    assert exits2[0][0] - start < 3.0
    assert "its processes are gone (connection refused)" in capfd.readouterr().err
    # under torchrun with restarts left, the line says what happens next
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert live.line([(peers[2], "x")], "y").endswith(
        "node 0 stops (y). torchrun restarts the workers, which resume from the last checkpoint"
    )
    live.stop()
    live2.stop()


def test_stopped_watcher_and_single_node_report_nothing(peer, capfd):
    mod = _load()
    proc, port = peer
    live, peers, exits, done = _watcher(mod, port, timeout=1.0, interval=0.2)
    live.start(peers)
    time.sleep(0.3)
    live.stop()  # a normal end: the peers may exit from now on
    proc.kill()
    proc.wait()
    assert not done.wait(1.2)  # > 2 pings
    assert capfd.readouterr().err == ""
    # one node: no other node to watch, no thread
    solo = mod.Liveness(1.0, exit=lambda code: pytest.fail("exit on one node"))
    me = solo.listen(rank=0, node=0, name="0", addr="127.0.0.1")
    solo.start([me, mod.Peer(1, 0, "0", me.host, "127.0.0.1", me.port, 0)])
    assert [t.name for t in solo._threads] == ["hdet-liveness-server"]
    solo.stop()
    with pytest.raises(ValueError):
        mod.Liveness(0)


def test_other_ranks_of_a_node_wait_for_its_lowest_rank_to_report(peer, capfd):
    """A rank that is not its node's lowest returns from diagnose() only once that rank has ended
    (or after the grace): exiting first would let torchrun stop the lowest rank before it prints."""
    mod = _load()
    head, head_port = peer  # alive: this node's lowest rank, still probing
    lost = socket.socket()
    lost.bind(("127.0.0.1", 0))
    lost_port = lost.getsockname()[1]
    lost.close()  # nothing listens: the lost node's port refuses
    assert mod.probe("127.0.0.1", lost_port, 1.0) == "gone"
    live = mod.Liveness(30, prog="test", interval=0.1, exit=lambda code: None)
    me = live.listen(rank=1, node=0, name="0", addr="127.0.0.1")
    live.peers = [
        mod.Peer(0, 0, "0", me.host, "127.0.0.1", head_port, head.pid),
        me,
        mod.Peer(2, 1, "1", "hostB", "127.0.0.1", lost_port, 0),
    ]
    start = time.monotonic()
    assert live.diagnose(RuntimeError("Connection closed by peer")) is True
    assert time.monotonic() - start >= live.head_grace()  # the head never ended: the full grace
    head.kill()
    head.wait()
    start = time.monotonic()
    assert live.diagnose(RuntimeError("Connection closed by peer")) is True
    assert time.monotonic() - start < live.head_grace()  # the head has ended: at once
    assert capfd.readouterr().err == ""  # only the lowest rank prints
    live.stop()
