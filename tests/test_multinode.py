"""Multi-node for real, on one machine: the launchers run as two local "nodes".

Each node is one launch of the real script (``run_multinode.sh``, ``pretrain_gpt_hdet.sh``, the
sbatch file under Slurm) with ``NNODES=2`` and its own ``NODE_RANK``; the two torchrun agents meet
at a c10d rendezvous on 127.0.0.1 (nothing leaves loopback). 2 gloo ranks per node, TP2 inside a
node and DP2 across the nodes, so the two HDET arms sit on different nodes.

- the uninterrupted run (reference): trains, converges, saves; metrics show two arms;
- node loss: node 1 is killed (agent and workers, SIGKILL) mid-window; node 0 stops within the
  bound with one line naming node 1 and its ranks; the tracker names the last complete
  checkpoint; relaunching both nodes (``MAX_RESTARTS=1``) resumes from it, and a worker killed
  later is restarted by torchrun and resumes from the newer checkpoint by itself: the loss curve
  of all of it is bit-identical to the reference;
- the Megatron-LM loop through the patch (``pretrain_gpt_hdet.sh``, patched copy of
  ``megatron.training`` on ``PYTHONPATH``) as two nodes;
- the sbatch file: its environment logic with a stub ``srun``/``scontrol`` (always), and the
  real thing under a single-host Slurm (slurmctld + slurmd started here) where installed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hdet_megatron.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "pretrain_gpt"
RUN_MULTINODE = EXAMPLES / "run_multinode.sh"
HDET_SH = EXAMPLES / "pretrain_gpt_hdet.sh"
SBATCH = EXAMPLES / "pretrain_gpt.sbatch"
TRACKER = "latest_checkpointed_iteration.txt"
NODE_TIMEOUT = 60  # --node-timeout of these runs (the default; a loaded 2-core machine needs it)

# The tiny model of every run here: 12 iterations, a window of 3, a checkpoint every 4.
TINY = {
    "TP": "2",
    "PP": "1",
    "MOCK": "1",
    "BACKEND": "gloo",
    "TRANSFORMER_IMPL": "local",
    "NUM_LAYERS": "2",
    "HIDDEN": "32",
    "HEADS": "4",
    "SEQ": "32",
    "MBS": "2",
    "GBS": "8",
    "TRAIN_ITERS": "12",
    "WARMUP": "2",
    "LR": "3e-3",
    "MIN_LR": "3e-4",
    "HDET_PERIOD": "3",
    "HDET_SPREAD": "0.3",
}
EXTRA = [
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--save-interval",
    "4",
    "--node-timeout",
    str(NODE_TIMEOUT),
]
LOST = re.compile(r"pretrain_gpt\.py: error: lost node (\d+) \(host \S+, ranks ([\d,\-]+)\): (.*)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(port: int, **more: str) -> dict:
    env = dict(os.environ)
    env.update(
        NNODES="2",
        GPUS_PER_NODE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHON=sys.executable,
        RDZV_ID=f"test-{port}",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.update(more)
    return env


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


class Node:
    """One launch of a script: the launcher, its torchrun agent and the agent's workers."""

    def __init__(self, script: Path, node_rank: int, env: dict, args: list[str], log: Path) -> None:
        self.log = log
        self._fh = open(log, "w")
        self.proc = subprocess.Popen(
            ["bash", str(script), *args],
            cwd=REPO,
            env=dict(env, NODE_RANK=str(node_rank)),
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tree(self) -> list[int]:
        kids, out, todo = _children(), [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += kids.get(pid, [])
        return out

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of this node's current workers."""
        ranks = {}
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"RANK" in env and b"LOCAL_RANK" in env:
                ranks[int(env[b"RANK"])] = pid
        return ranks

    def kill(self) -> None:
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            pytest.fail(f"{self.log.name} still running after {timeout} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        self._fh.flush()
        return self.log.read_text(errors="replace")


@pytest.fixture
def nodes():
    """Started nodes; whatever still runs at the end is killed."""
    started: list[Node] = []
    yield started
    for node in started:
        if node.proc.poll() is None:
            node.kill()
        node.proc.wait()
        node._fh.close()


def launch_pair(started: list, script: Path, env: dict, args: list[str], tag: str, tmp: Path) -> list[Node]:
    pair = [Node(script, rank, env, args, tmp / f"{tag}.node{rank}.log") for rank in (0, 1)]
    started += pair
    return pair


def wait_for(cond, pair: list[Node], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if all(n.proc.poll() is not None for n in pair) or time.monotonic() > end:
            logs = "\n".join(f"== {n.log.name}\n{n.text()[-3000:]}" for n in pair)
            pytest.fail(f"never saw {what}\n{logs}")
        time.sleep(0.02)


def tracker(save: Path) -> str:
    try:
        return (save / TRACKER).read_text()
    except OSError:
        return ""


def ranks_of(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def last_steps(records: list[dict]) -> dict[int, dict]:
    """Iteration -> its step record; a resumed run's records replace the dead run's."""
    return {r["iteration"]: r for r in records if r["type"] == "step"}


# -- the uninterrupted two-node run ---------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    save = tmp / "ckpt"
    started: list[Node] = []
    try:
        pair = launch_pair(
            started, RUN_MULTINODE, base_env(free_port(), SAVE=str(save), **TINY), EXTRA, "ref", tmp
        )
        # Which ranks each node holds (torchrun numbers the nodes in rendezvous order).
        wait_for(lambda: all(len(n.workers()) == 2 for n in pair), pair, 300, "2 workers per node")
        layout = [sorted(n.workers()) for n in pair]
        codes = [n.wait(300) for n in pair]
        return {
            "save": save,
            "codes": codes,
            "layout": layout,
            "logs": [n.text() for n in pair],
            "records": read_metrics(str(save)),
        }
    finally:
        for n in started:
            if n.proc.poll() is None:
                n.kill()
            n.proc.wait()


@pytest.mark.slow
def test_two_nodes_train_converge_save(reference):
    assert reference["codes"] == [0, 0], "\n".join(log[-3000:] for log in reference["logs"])
    # TP2 inside a node, DP2 across: each node holds one TP group = one arm.
    assert sorted(map(tuple, reference["layout"])) == [(0, 1), (2, 3)]
    for node, log in enumerate(reference["logs"]):
        assert f"run_multinode.sh: node {node}/2, world 4 = TP2 x PP1 x DP2, 2 HDET arms" in log
    rank0_log = [
        log for log, ranks in zip(reference["logs"], reference["layout"], strict=True) if 0 in ranks
    ][0]
    assert "HDET on: 2 arms over DP2, period 3" in rank0_log and "done: 12 iterations" in rank0_log
    records = reference["records"]
    run = records[0]
    assert run["type"] == "run" and (run["tp"], run["pp"], run["dp"], run["arms"], run["world"]) == (
        2,
        1,
        2,
        2,
        4,
    )
    steps = last_steps(records)
    assert sorted(steps) == list(range(1, 13))
    for it, s in steps.items():
        assert len(s["arm_losses"]) == 2 and len(s["arm_lrs"]) == 2, s
        if it > 1:  # the arms train with different LRs (0 at the first warm-up step)
            assert s["arm_lrs"][0] != s["arm_lrs"][1]
    windows = [(w["iteration"], w["forced"]) for w in records if w["type"] == "window"]
    assert windows == [(3, False), (4, True), (7, False), (8, True), (11, False), (12, True)]
    assert all(
        len(w["arm_losses"]) == 2 and w["converge_bytes"] > 0 for w in records if w["type"] == "window"
    )
    assert steps[12]["loss"] < steps[1]["loss"] - 0.2  # it learned
    save = reference["save"]
    assert tracker(save) == "12"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000012"]


# -- node loss, relaunch, elastic restart ----------------------------------------------------------
@pytest.mark.slow
def test_node_loss_then_relaunch_and_elastic_restart(reference, nodes, tmp_path):
    assert reference["codes"] == [0, 0]
    save = tmp_path / "ckpt"

    # 1. Both nodes train; right after the checkpoint of iteration 4 (mid-window: windows end at
    #    3, 4 (forced by the save), 7), node 1 is lost: its agent and workers are SIGKILLed.
    pair = launch_pair(
        nodes, RUN_MULTINODE, base_env(free_port(), SAVE=str(save), **TINY), EXTRA, "loss", tmp_path
    )
    wait_for(lambda: len(pair[1].workers()) == 2, pair, 300, "node 1's workers")
    lost_ranks, victims = sorted(pair[1].workers()), pair[1].tree()
    wait_for(lambda: tracker(save) == "4", pair, 300, "the checkpoint of iteration 4")
    for pid in victims:  # (collected beforehand: the kill lands at once)
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    code = pair[0].wait(120)
    stopped_after = time.monotonic() - killed
    log = pair[0].text()
    assert code != 0 and "done:" not in log
    # Bounded: the gone processes are seen at the next cross-node collective or within two pings
    # (timeout / 10 apart), well before the timeout for a silent node.
    assert stopped_after < NODE_TIMEOUT, stopped_after
    lines = [m for m in LOST.finditer(log)]
    assert len(lines) == 1, log[-4000:]  # one line, from the surviving node's first rank
    assert lines[0][1] == "1" and ranks_of(lines[0][2]) == lost_ranks, lines[0][0]
    # (a SIGKILLed node's port refuses at once; one still being torn down may just not answer)
    assert re.match(r"(its processes are gone|not answering).* at iteration \d+; node 0 stops", lines[0][3])
    assert 'pretrain_gpt.py", line' not in log  # no worker traceback

    # 2. On disk: the tracker names the last complete checkpoint. A half-written later one (what
    #    a node dying mid-save leaves) is ignored on load and replaced by the next save.
    resume_at = int(tracker(save))
    assert resume_at in (4, 8)
    stale = save / f"iter_{resume_at + 4:07d}"
    stale.mkdir(exist_ok=True)
    (stale / "__1_0.distcp").write_bytes(b"\0" * 100)  # a shard written, no .metadata yet

    # 3. Relaunch both nodes with MAX_RESTARTS=1; after the checkpoint of iteration 8, one worker
    #    is killed: torchrun restarts the workers of both nodes, which resume from iteration 8.
    pair = launch_pair(
        nodes,
        RUN_MULTINODE,
        base_env(free_port(), SAVE=str(save), MAX_RESTARTS="1", **TINY),
        EXTRA,
        "relaunch",
        tmp_path,
    )
    wait_for(lambda: len(pair[1].workers()) == 2, pair, 300, "node 1's workers")
    workers = pair[1].workers()
    wait_for(lambda: tracker(save) == "8", pair, 300, "the checkpoint of iteration 8")
    os.kill(workers[max(workers)], signal.SIGKILL)
    codes = [n.wait(300) for n in pair]
    logs = "".join(n.text() for n in pair)
    assert codes == [0, 0], logs[-6000:]
    assert f"resumed from {save}/iter_{resume_at:07d} at iteration {resume_at}" in logs
    assert f"resumed from {save}/iter_0000008 at iteration 8" in logs
    assert "done: 4 iterations" in logs  # the restarted workers ran 9..12
    assert sorted(os.listdir(save / "iter_0000012")) == sorted(os.listdir(save / "iter_0000008"))
    assert (stale / "__1_0.distcp").read_bytes() != b"\0" * 100  # replaced by the save of that iteration
    assert tracker(save) == "12"

    # 4. The loss curve of the interrupted, relaunched and restarted run is the reference's.
    records = read_metrics(str(save))
    runs = [r["resumed_from"] for r in records if r["type"] == "run"]
    assert runs == [None, resume_at, 8], runs
    ref, got = last_steps(reference["records"]), last_steps(records)
    assert sorted(got) == list(range(1, 13))
    for it in range(1, 13):
        assert got[it]["loss"] == ref[it]["loss"], it
        assert got[it]["arm_losses"] == ref[it]["arm_losses"], it
        assert got[it]["arm_lrs"] == ref[it]["arm_lrs"], it
    final = [r for r in records if r["type"] == "final"][-1]
    ref_final = [r for r in reference["records"] if r["type"] == "final"][-1]
    assert final["train_loss"] == ref_final["train_loss"] and final["scales"] == ref_final["scales"]


# -- Megatron-LM's loop through the patch ---------------------------------------------------------
@pytest.mark.slow
def test_patched_megatron_loop_two_nodes(nodes, tmp_path):
    from tests.test_training_patch import CPU_FLAGS, TINY_GPT, hdet_converges, make_copy, run_apply

    overlay = make_copy(tmp_path / "overlay")
    applied = run_apply("--target", str(overlay))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    ckpt = tmp_path / "ckpt"
    env = base_env(
        free_port(),
        PYTHONPATH=str(overlay),
        TP="2",
        CKPT_DIR=str(ckpt),
        TRAIN_ITERS="6",
        GLOBAL_BATCH="8",
        MICRO_BATCH="2",
    )
    args = [
        *CPU_FLAGS,
        *TINY_GPT,
        "--train-iters",
        "6",
        "--lr-decay-iters",
        "12",
        "--hdet-period",
        "2",
        "--hdet-spread",
        "0.5",
        "--save-interval",
        "4",
    ]
    pair = launch_pair(nodes, HDET_SH, env, args, "hdet", tmp_path)
    codes = [n.wait(400) for n in pair]
    logs = [n.text() for n in pair]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    out = "".join(logs)
    assert "[HDET] on: 2 arms over DP 2" in out
    conv = hdet_converges(out)
    assert [(c["iteration"], c["forced"]) for c in conv] == [(2, False), (4, False), (6, False)], conv
    assert all(len(c["losses"]) == 2 for c in conv)
    assert "successfully saved checkpoint from iteration       6" in out
    assert (ckpt / TRACKER).read_text().strip() == "6"


def test_launch_line_names_the_arm_count_in_use(tmp_path):
    """The launcher's line names the arms the run uses: --hdet-arms (yours win over ARMS), one per
    DP replica by default, or HDET off (issue 27). torchrun is a stand-in that records its argv."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        'if [[ "$1 $2" == "-m torch.distributed.run" ]]; then echo "torchrun stand-in"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    fake.chmod(0o755)
    env = dict(base_env(free_port(), PYTHON=str(fake), SAVE=str(tmp_path / "ckpt"), **TINY), NNODES="1")
    env["GPUS_PER_NODE"] = "8"  # TP2 x PP1 -> DP4
    for extra, arms_env, want in (
        ([], None, "4 HDET arms"),  # one per DP replica
        ([], "2", "2 HDET arms"),  # ARMS
        (["--hdet-arms", "2"], None, "2 HDET arms"),
        (["--hdet-arms", "4"], "2", "4 HDET arms"),  # the flag wins over ARMS
        (["--hdet-arms=1"], "2", "1 HDET arm"),
        (["--no-hdet"], "2", "HDET off"),
    ):
        run_env = dict(env, ARMS=arms_env) if arms_env else env
        r = subprocess.run(
            ["bash", str(RUN_MULTINODE), *extra],
            env=run_env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"world 8 = TP2 x PP1 x DP4, {want}, master" in r.stdout, (extra, arms_env, r.stdout)


# -- Slurm ----------------------------------------------------------------------------------------
_STUB_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || { echo "stub scontrol: $*" >&2; exit 1; }
[[ "$3" == "gpu-[07-08]" ]] || { echo "stub scontrol: unexpected node list $3" >&2; exit 1; }
echo gpu-07; echo gpu-08
"""
_STUB_SRUN = """#!/bin/bash
# 2 tasks, one per node, as Slurm would start them.
echo "srun $1"
shift
for i in 0 1; do SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 "$@" || exit $?; done
"""
_STUB_LAUNCHER = """echo "task pwd=$PWD NNODES=$NNODES NODE_RANK=$NODE_RANK MASTER_ADDR=$MASTER_ADDR \
MASTER_PORT=$MASTER_PORT GPUS_PER_NODE=$GPUS_PER_NODE SAVE=$SAVE args=$*"
"""


def test_sbatch_environment_with_stub_slurm(tmp_path):
    """The sbatch file's own logic: master = first host of the node list, NNODES = tasks,
    NODE_RANK = the task's rank (= SLURM_NODEID, one task per node), SAVE under the repo."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", _STUB_SCONTROL), ("srun", _STUB_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    repo = tmp_path / "repo"
    (repo / "examples" / "pretrain_gpt").mkdir(parents=True)
    (repo / "examples" / "pretrain_gpt" / "run_multinode.sh").write_text(_STUB_LAUNCHER)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "gpu-[07-08]",
        "SLURM_JOB_NAME": "hdet-gpt",
        "SLURM_SUBMIT_DIR": str(repo),
        "SLURM_GPUS_ON_NODE": "4",
    }
    r = subprocess.run(
        ["bash", str(SBATCH), "--hdet-period", "50"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "srun --kill-on-bad-exit=1"
    for rank, line in enumerate(lines[1:]):
        assert line == (
            f"task pwd={repo} NNODES=2 NODE_RANK={rank} MASTER_ADDR=gpu-07 MASTER_PORT=29500 "
            f"GPUS_PER_NODE=4 SAVE={repo}/checkpoints/hdet-gpt-hdet-gpt args=--hdet-period 50"
        )
    assert len(lines) == 3


SLURM_CONF = """ClusterName=hdettest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmUser=root
SlurmdUser=root
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _slurm_missing() -> str:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol") if not shutil.which(b)]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing; Debian/Ubuntu: "
            "apt-get install slurm-wlm); a manual check (docs/testing.md), the sbatch environment "
            "is covered by the stub test"
        )
    if os.geteuid() != 0:
        return "a single-host Slurm needs root here (slurmd launches the job's tasks); see docs/testing.md"
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_slurm_missing()), reason=_slurm_missing() or "-")
def test_sbatch_under_single_host_slurm(tmp_path):
    d = tmp_path / "slurm"
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=socket.gethostname().split(".")[0], d=d, ctld_port=free_port(), d_port=free_port()
        )
    )
    env = base_env(free_port(), SLURM_CONF=str(conf), SAVE=str(tmp_path / "ckpt"), **TINY)
    env["TRAIN_ITERS"] = "4"
    env.pop("NNODES")  # the sbatch file sets it (from the tasks)
    daemons = [
        subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ),
        subprocess.Popen(
            ["slurmd", "-D", "-N", "localhost", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ),
    ]
    try:
        end = time.monotonic() + 60
        while True:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if r.stdout.strip() == "idle":
                break
            assert time.monotonic() < end, f"Slurm did not come up: {r.stdout}{r.stderr}\n" + "".join(
                p.read_text() for p in d.glob("*.log")
            )
            time.sleep(0.3)
        out = tmp_path / "job.out"
        r = subprocess.run(
            [
                "sbatch",
                "--wait",
                "--nodes=1",
                "--ntasks=2",
                "--ntasks-per-node=2",
                "--cpus-per-task=1",
                "--gpus-per-node=0",
                "--time=10",
                f"--output={out}",
                "--export=ALL",
                str(SBATCH),
                *EXTRA,
            ],
            env=dict(env, REPO=str(REPO)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        text = out.read_text() if out.exists() else ""
        assert r.returncode == 0, r.stdout + r.stderr + text[-5000:]
        assert "run_multinode.sh: node 0/2, world 4 = TP2 x PP1 x DP2, 2 HDET arms, master localhost" in text
        assert "run_multinode.sh: node 1/2" in text
        assert "HDET on: 2 arms over DP2" in text and "done: 4 iterations" in text
        steps = last_steps(read_metrics(str(tmp_path / "ckpt")))
        assert sorted(steps) == [1, 2, 3, 4] and all(len(s["arm_losses"]) == 2 for s in steps.values())
        assert (tmp_path / "ckpt" / TRACKER).read_text() == "4"
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
