"""Node liveness for multi-node runs: a lost node stops the others within a bounded time, with
one line that names it.

A collective with a peer whose node died fails fast on gloo (the peer's sockets are closed) but
waits for the process-group timeout on NCCL (10 minutes by default), and a node that hangs
(frozen, unreachable) stalls every backend until then. :class:`Liveness` bounds both:

- every rank listens on a small TCP port (a daemon thread answers ``ok`` to each connection);
  the ports, hosts and node ids are exchanged once at startup (one ``all_gather_object``);
- the lowest rank of each node pings the lowest rank of every other node every ``interval``
  seconds (``timeout / 10``, 0.2 to 5 s): a node whose port refuses two pings in a row (its
  processes are gone) or that has not answered for ``timeout`` seconds (frozen or unreachable)
  is *lost*: the pinging rank prints one line naming it and ends its process, and torchrun stops
  the node's other workers (or restarts the group under ``--max-restarts``);
- :meth:`Liveness.diagnose` probes the other nodes at once, for a collective that failed in the
  main thread (gloo): the same line, printed once per node by its lowest rank; the node's other
  ranks wait (a bounded time) until that rank has ended before they end theirs.

Nothing here talks to anything but the run's own ranks; with one node (or one rank) it does
nothing. The advertised address is the one this host uses to reach ``MASTER_ADDR`` (loopback
when the master is this host).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Exit status of a rank that stopped because a node was lost.
EXIT_NODE_LOST = 75

_REPLY = b"ok"


@dataclass(frozen=True)
class Peer:
    """One rank's liveness endpoint (host, address, port) and node, exchanged once at startup."""

    rank: int
    node: int  # torchrun's GROUP_RANK (the rendezvous' node index)
    name: str  # the launcher's NODE_RANK when set, else the node index
    host: str
    addr: str
    port: int
    pid: int


def advertised_addr(master_addr: str | None = None) -> str:
    """The local address on the route to ``MASTER_ADDR`` (no packet is sent: a UDP ``connect``
    only picks the route); loopback when the master is this host or no master is set."""
    master = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def probe(addr: str, port: int, timeout: float) -> str:
    """``"ok"``, ``"gone"`` (connection refused: no process listens) or ``"unresponsive"``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return "ok" if s.recv(len(_REPLY)) == _REPLY else "unresponsive"
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "unresponsive"


def _short(error: BaseException) -> str:
    """The gist of a collective's error: its first sentence without gloo's source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")
    text = text.split(". ")[0].rstrip(".")
    return text[:100] or type(error).__name__


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class Liveness:
    """See the module docstring. ``prog`` prefixes the line; ``status()`` adds where training was
    (e.g. ``"at iteration 6"``); ``exit`` ends the process (tests replace it)."""

    def __init__(
        self,
        timeout: float,
        *,
        prog: str = "hdet",
        interval: float | None = None,
        status: Callable[[], str] = lambda: "",
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0")
        self.timeout = float(timeout)
        self.interval = float(interval) if interval else min(5.0, max(0.2, self.timeout / 10))
        self.prog, self.status, self._exit = prog, status, exit
        self.peers: list[Peer] = []
        self.me: Peer | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._reported = False
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    # -- setup ---------------------------------------------------------------------------------
    def listen(self, rank: int, node: int, name: str, addr: str | None = None) -> Peer:
        """Open this rank's port and start answering; returns this rank's :class:`Peer`."""
        addr = addr or advertised_addr()
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind((addr, 0))
        server.listen(64)
        server.settimeout(0.5)
        self._server = server
        self.me = Peer(rank, node, name, socket.gethostname(), addr, server.getsockname()[1], os.getpid())
        self._spawn(self._serve, "hdet-liveness-server")
        return self.me

    def start(self, peers: list[Peer]) -> None:
        """Every rank's :class:`Peer` (e.g. from ``all_gather_object``); the lowest rank of each
        node starts pinging the other nodes."""
        self.peers = sorted(peers, key=lambda p: p.rank)
        if self.me is not None and self.me.rank == min(p.rank for p in self.peers if p.node == self.me.node):
            if self._targets():
                self._spawn(self._watch, "hdet-liveness-watch")

    def _spawn(self, fn, name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _targets(self) -> list[Peer]:
        """The lowest rank of every other node."""
        heads: dict[int, Peer] = {}
        for p in self.peers:
            if self.me is not None and p.node == self.me.node:
                continue
            if p.node not in heads or p.rank < heads[p.node].rank:
                heads[p.node] = p
        return list(heads.values())

    # -- threads -------------------------------------------------------------------------------
    def _serve(self) -> None:
        server = self._server
        assert server is not None  # started after the server socket is bound
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                conn.sendall(_REPLY)
            except OSError:
                pass
            finally:
                conn.close()

    def _watch(self) -> None:
        targets = self._targets()
        last_ok = {p.node: time.monotonic() for p in targets}
        refused = {p.node: 0 for p in targets}
        while not self._stop.wait(self.interval):
            lost = []
            for p in targets:
                state = probe(p.addr, p.port, timeout=min(self.interval, 2.0))
                now = time.monotonic()
                if state == "ok":
                    last_ok[p.node], refused[p.node] = now, 0
                    continue
                refused[p.node] = refused[p.node] + 1 if state == "gone" else 0
                silent = now - last_ok[p.node]
                if refused[p.node] >= 2:
                    lost.append((p, "its processes are gone (connection refused)"))
                elif silent >= self.timeout:
                    lost.append((p, f"no answer for {silent:.0f} s"))
            if lost and not self._stop.is_set():
                self._lost(lost, how=f"heartbeat, --node-timeout {self.timeout:g} s")
                return

    # -- reporting -----------------------------------------------------------------------------
    def line(self, lost: list[tuple[Peer, str]], how: str) -> str:
        parts = []
        for p, why in lost:
            ranks = [q.rank for q in self.peers if q.node == p.node]
            parts.append(f"node {p.name} (host {p.host}, ranks {_ranks(ranks)}): {why}")
        status = self.status()
        me = self.me
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) - int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0
        )
        then = (
            "torchrun restarts the workers, which resume from the last checkpoint"
            if left > 0
            else "Relaunch every node to resume from the last checkpoint"
        )
        return (
            f"{self.prog}: error: lost {'; '.join(parts)}{' ' + status if status else ''}; "
            f"node {me.name if me else '?'} stops ({how}). {then}"
        )

    def _lost(self, lost: list[tuple[Peer, str]], how: str) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported = True
        print(self.line(lost, how), file=sys.stderr, flush=True)
        self._exit(EXIT_NODE_LOST)

    def diagnose(self, error: BaseException) -> bool:
        """After a failed collective: probe the other nodes now; when one is lost, report it
        (from this node's lowest rank; the others stay quiet and return once it has ended) and
        return True."""
        if self.me is None or not self.peers:
            return False
        lost = []
        for p in self._targets():
            state = probe(p.addr, p.port, timeout=min(self.timeout, 2.0))
            # A node being killed may still hold its port for a moment: probe again briefly
            # until it answers or is plainly gone.
            end = time.monotonic() + min(self.timeout, 3.0)
            while state == "unresponsive" and time.monotonic() < end:
                time.sleep(0.2)
                state = probe(p.addr, p.port, timeout=0.5)
            if state != "ok":
                lost.append(
                    (p, "its processes are gone (connection refused)" if state == "gone" else "not answering")
                )
        if not lost:
            return False
        head = min((p for p in self.peers if p.node == self.me.node), key=lambda p: p.rank)
        if self.me.rank == head.rank:
            first = _short(error)
            with self._lock:
                if self._reported:
                    return True
                self._reported = True
            print(self.line(lost, f"a collective failed: {first}"), file=sys.stderr, flush=True)
        else:
            self._await_head(head)
        return True

    def head_grace(self) -> float:
        """How long a node's other ranks wait for its lowest rank to report (:meth:`diagnose`):
        two heartbeats (its watcher's bound for a gone node) plus its own probing of a node still
        being torn down (3 s)."""
        return 2 * self.interval + 3.0

    def _await_head(self, head: Peer) -> None:
        """Return once this node's lowest rank has ended (its port refuses: it has printed the
        line, or stopped), or after :meth:`head_grace`. A rank that exits first makes torchrun
        stop the node's other workers, the lowest one among them before it could print."""
        end = time.monotonic() + self.head_grace()
        while time.monotonic() < end:
            if probe(head.addr, head.port, timeout=0.5) == "gone":
                return
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop pinging and answering (before a normal exit)."""
        self._stop.set()
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass


def start_liveness(timeout: float, *, prog: str, status: Callable[[], str] = lambda: "") -> Liveness | None:
    """For a torchrun world spread over more than one node: exchange the ports (a collective on
    the default group) and start; ``None`` on one node or with ``timeout <= 0``."""
    import torch.distributed as dist

    if timeout <= 0 or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes <= 1:
        return None
    node = int(os.environ.get("GROUP_RANK", "0"))
    live = Liveness(timeout, prog=prog, status=status)
    me = live.listen(dist.get_rank(), node, os.environ.get("NODE_RANK", str(node)))
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, me)
    live.start(peers)
    return live
