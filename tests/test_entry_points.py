"""Every entry point, bad input by bad input: exit code 2 (or the script's documented code), one
line naming the flag or file and the fix, never a traceback (issue 20).

One table (:data:`CASES`) covers ``hdet simulate``, ``hdet report``, ``pretrain_gpt.py``,
``pretrain_gpt_hdet.py`` (Megatron-LM's flags through the patch), ``patches/apply.sh`` and the
launch scripts (``demo_cpu.sh``, ``run_multinode.sh``, ``pretrain_gpt.sbatch``,
``pretrain_gpt_hdet.sh``). Cheap by construction: ``hdet`` and ``pretrain_gpt.py`` run in this
process (``main(argv)``; a case that wrongly passed validation would hit the tripwire instead of
starting a process group), ``pretrain_gpt_hdet.py``'s cases share one subprocess (one
``megatron.training`` import), the shell scripts fail in their pre-torchrun check.

Placeholders in a case's argv/env (``{data}``, ``{ckpt_bad_tracker}``, ...) are files made by
:func:`files`. The count of cases is quoted in README "Troubleshooting" and
docs/troubleshooting.md (``test_case_count_matches_the_docs``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "pretrain_gpt"
APPLY = REPO / "patches" / "apply.sh"


# --- the table ----------------------------------------------------------------------------------
# (id, entry point, argv, env, expected exit code, substrings of the one error line:
#  the flag or file it names, and the fix it suggests)
C = []


def case(id_, entry, argv, *needles, rc=2, env=None):
    C.append((id_, entry, list(argv), dict(env or {}), rc, needles))


# hdet simulate: zero, negative, non-numeric, out of range, conflicting
case("sim_arms_0", "hdet", ["simulate", "--arms", "0"], "--arms", "integer in [1, 4096]")
case("sim_replicas_0", "hdet", ["simulate", "--replicas-per-arm", "0"], "--replicas-per-arm", "in [1, 4096]")
case("sim_arms_text", "hdet", ["simulate", "--arms", "eight"], "--arms", "expected an integer")
case("sim_arms_huge", "hdet", ["simulate", "--arms", "100000"], "--arms", "in [1, 4096]")
case("sim_period_neg", "hdet", ["simulate", "--period", "-5"], "--period", ">= 1")
case("sim_spread_ge_1", "hdet", ["simulate", "--spread", "1.5"], "--spread", "use spread < 1")
case("sim_spread_neg", "hdet", ["simulate", "--spread", "-0.1"], "--spread", ">= 0")
case("sim_spread_nan", "hdet", ["simulate", "--spread", "nan"], "--spread", "finite number")
case("sim_sigma_0", "hdet", ["simulate", "--sigma", "0"], "--sigma", "> 0 or 'auto'")
case("sim_momentum_1", "hdet", ["simulate", "--momentum", "1"], "--momentum", "< 1")
case("sim_base_lr_0", "hdet", ["simulate", "--base-lr", "0"], "--base-lr", "> 0")
case(
    "sim_lr_conflict",
    "hdet",
    ["simulate", "--base-lr", "0.1", "--base-lr-factor", "2"],
    "--base-lr-factor",
    "not allowed with argument --base-lr",
)
case(
    "sim_steps_lt_period",
    "hdet",
    ["simulate", "--steps", "50", "--period", "100"],
    "--steps 50",
    "give --steps >= --period",
)
case("sim_kind_bad", "hdet", ["simulate", "--kind", "cubic"], "--kind", "choose from")
case("sim_unknown_flag", "hdet", ["simulate", "--armz", "4"], "--armz", "--help")
case("sim_every_0", "hdet", ["simulate", "--every", "0"], "--every", ">= 1")
# hdet report: missing files, another job's run dir, unreadable metrics, bad flags
case("report_missing_dir", "hdet", ["report", "{tmp}/nope"], "nope", "the --run-dir (or --save)")
case("report_no_metrics", "hdet", ["report", "{empty_dir}"], "no metrics.jsonl", "the --run-dir (or --save)")
case(
    "report_foreign_metrics", "hdet", ["report", "{foreign_run}"], "metrics.jsonl", "no HDET metrics records"
)
case(
    "report_binary_metrics", "hdet", ["report", "{binary_run}"], "metrics.jsonl", "the --run-dir (or --save)"
)
case("report_empty_metrics", "hdet", ["report", "{empty_run}"], "metrics.jsonl is empty", "the --run-dir")
case("report_smooth_0", "hdet", ["report", "{good_run}", "--smooth", "0"], "--smooth", ">= 1")
case(
    "report_output_dir_missing",
    "hdet",
    ["report", "{good_run}", "-o", "{tmp}/no/dir/r.png"],
    "-o",
    "create it or write the PNG elsewhere",
)
case("report_output_not_png", "hdet", ["report", "{good_run}", "-o", "{tmp}/r.txt"], "-o", "ending in .png")
case(
    "report_output_no_plot",
    "hdet",
    ["report", "{good_run}", "-o", "{tmp}/r.png", "--no-plot"],
    "--no-plot",
    "drop one of them",
)
case(
    "report_output_foreign",
    "hdet",
    ["report", "{good_run}", "-o", "{foreign_png}"],
    "my_plot.png exists and was not written by hdet report",
    "write the plot elsewhere",
)
case("hdet_no_command", "hdet", [], "COMMAND", "--help")

# pretrain_gpt.py (main(argv) with WORLD_SIZE=4): sizes vs. the world, flags, data, checkpoints
M = ["--mock-data"]
case("pg_hdet_arms_3", "pretrain_gpt", [*M, "--hdet-arms", "3"], "--hdet-arms 3", "use one of [1, 2, 4]")
case("pg_hdet_arms_0", "pretrain_gpt", [*M, "--hdet-arms", "0"], "--hdet-arms", ">= 1")
case("pg_hdet_period_0", "pretrain_gpt", [*M, "--hdet-period", "0"], "--hdet-period", "integer >= 1")
case(
    "pg_hdet_period_text",
    "pretrain_gpt",
    [*M, "--hdet-period", "ten"],
    "--hdet-period",
    "expected an integer",
)
case(
    "pg_hdet_temperature_neg",
    "pretrain_gpt",
    [*M, "--hdet-temperature", "-1"],
    "--hdet-temperature",
    "'auto'",
)
case("pg_hdet_momentum_1", "pretrain_gpt", [*M, "--hdet-momentum", "1.5"], "--hdet-momentum", "in [0, 1)")
case("pg_hdet_spread_ge_1", "pretrain_gpt", [*M, "--hdet-spread", "1.2"], "--hdet-spread", "use spread < 1")
case(
    "pg_hdet_axis_unknown",
    "pretrain_gpt",
    [*M, "--hdet-axis", "momentum:0.1"],
    "--hdet-axis momentum:0.1",
    "use one of",
)
case(
    "pg_hdet_axis_conflict",
    "pretrain_gpt",
    [*M, "--hdet-spread", "0.2", "--hdet-axis", "lr:0.1"],
    "--hdet-spread and --hdet-axis conflict",
    "inside --hdet-axis",
)
case(
    "pg_hdet_bounds",
    "pretrain_gpt",
    [*M, "--hdet-scale-bounds", "2", "0.5"],
    "--hdet-scale-bounds",
    "0 < c_min <= 1 <= c_max",
)
case(
    "pg_no_hdet_conflict",
    "pretrain_gpt",
    [*M, "--no-hdet", "--hdet-period", "5"],
    "--no-hdet conflicts with --hdet-period",
    "drop --no-hdet",
)
case(
    "pg_tp_3",
    "pretrain_gpt",
    [*M, "--tensor-model-parallel-size", "3"],
    "TP x PP = 3 x 1",
    "--tensor-model-parallel-size",
)
case("pg_micro_batch_0", "pretrain_gpt", [*M, "--micro-batch-size", "0"], "--micro-batch-size", ">= 1")
case("pg_lr_negative", "pretrain_gpt", [*M, "--lr", "-1"], "--lr", "--lr > 0")
case(
    "pg_global_batch",
    "pretrain_gpt",
    [*M, "--global-batch-size", "6"],
    "--global-batch-size 6",
    "micro-batch-size x DP",
)
case("pg_no_data", "pretrain_gpt", [], "--data-path", "--mock-data")
case("pg_data_missing", "pretrain_gpt", ["--data-path", "{tmp}/corpus"], "corpus", "prepare_data.py")
case(
    "pg_data_and_mock",
    "pretrain_gpt",
    [*M, "--data-path", "{data}"],
    "--mock-data conflicts with --data-path",
    "give one of them",
)
case("pg_load_is_file", "pretrain_gpt", [*M, "--load", "{a_file}"], "--load", "give the --save directory")
case(
    "pg_ckpt_bad_tracker",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_bad_tracker}"],
    "latest_checkpointed_iteration.txt",
    "expected an iteration number",
)
case(
    "pg_ckpt_tracker_dangling",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_dangling}"],
    "iter_0000020",
    "pass --ckpt-step N",
)
case(
    "pg_ckpt_step_missing",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_truncated}", "--ckpt-step", "7"],
    "--ckpt-step 7",
    "pass --ckpt-step N",
)
case(
    "pg_ckpt_truncated",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_truncated}"],
    ".metadata is empty",
    "save it again",
)
case(
    "pg_ckpt_bad_metadata", "pretrain_gpt", [*M, "--load", "{ckpt_bad_metadata}"], "metadata.json", "damaged"
)
case(
    "pg_ckpt_empty_iter",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_empty_iter}"],
    "iter_0000010",
    "interrupted save",
)
case(
    "pg_ckpt_legacy_empty",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_legacy_empty}"],
    "model_optim_rng.pt",
    "save it again",
)
case("pg_load_other_job", "pretrain_gpt", [*M, "--load", "{other_job}"], "--load", "belongs to another job")
case(
    "pg_run_dir_other_job",
    "pretrain_gpt",
    [*M, "--run-dir", "{other_job}"],
    "--hidden-size 256 there",
    "use a new directory",
)
case(
    "pg_save_other_job",
    "pretrain_gpt",
    [*M, "--save", "{other_job}", "--num-layers", "2"],
    "--save",
    "give the same model flags",
)
case(
    "pg_save_other_checkpoints",
    "pretrain_gpt",
    [*M, "--save", "{ckpt_two}"],
    "already holds checkpoints (iter_0000020) of another run",
    "pass --load",
)
case(
    "pg_save_after_ckpt_step",
    "pretrain_gpt",
    [*M, "--load", "{ckpt_two}", "--save", "{ckpt_two}", "--ckpt-step", "10"],
    "holds iter_0000020, after the checkpoint this run resumes (--ckpt-step 10)",
    "--save NEW",
)
case("pg_unknown_flag", "pretrain_gpt", [*M, "--hdet-perod", "5"], "--hdet-perod", "unrecognized")

# pretrain_gpt_hdet.py: Megatron-LM's parser and checks (patched megatron.training), HDET flags
case("mlm_hdet_arms_3", "mlm", ["--hdet-arms", "3"], "--hdet-arms 3", "use one of [1, 2, 4]")
case("mlm_hdet_period_0", "mlm", ["--hdet-period", "0"], "--hdet-period", "integer >= 1")
case(
    "mlm_hdet_signal_average_2_arms",
    "mlm",
    ["--hdet-signal", "average", "--hdet-arms", "2"],
    "--hdet-signal average",
    "needs >= 3 arms, this run has 2",
    "use --hdet-signal probe",
)
case(
    "mlm_axis_conflict",
    "mlm",
    ["--hdet-spread", "0.2", "--hdet-axis", "lr:0.1"],
    "--hdet-axis",
    "inside --hdet-axis",
)
case(
    "mlm_precision_aware",
    "mlm",
    ["--use-precision-aware-optimizer"],
    "--use-precision-aware-optimizer is not supported by HDET",
    "train with --no-hdet",
)
case("mlm_num_layers_text", "mlm", ["--num-layers", "x"], "--num-layers", "--help")
case("mlm_unknown_flag", "mlm", ["--hdet-perod", "5"], "--hdet-perod", "--help")
case(
    "mlm_tp_3", "mlm", ["--tensor-model-parallel-size", "3"], "world size (4)", "--tensor-model-parallel-size"
)
case("mlm_heads", "mlm", ["--num-attention-heads", "3"], "--num-attention-heads", "change those flags")
case("mlm_micro_batch_0", "mlm", ["--micro-batch-size", "0"], "--micro-batch-size > 0", "change those flags")
case(
    "mlm_load_bad_tracker",
    "mlm",
    ["--load", "{ckpt_bad_tracker}"],
    "latest_checkpointed_iteration.txt",
    "expected an iteration number",
)
case(
    "mlm_save_other_checkpoints",
    "mlm",
    ["--save", "{ckpt_two}", "--save-interval", "4"],
    "already holds checkpoints (iter_0000020) of another run",
    "pass --load",
)
case(
    "mlm_save_after_ckpt_step",
    "mlm",
    ["--load", "{ckpt_two}", "--save", "{ckpt_two}", "--save-interval", "4", "--ckpt-step", "10"],
    "holds iter_0000020, after the checkpoint this run resumes (--ckpt-step 10)",
    "--save NEW",
)

# patches/apply.sh (documented codes: 2 usage, 3 interpreter / megatron-core)
case("apply_unknown", "apply", ["--bogus"], "--bogus", "--help")
case("apply_target_no_value", "apply", ["--target"], "--target", "DIR")
case("apply_target_missing", "apply", ["--target", "{tmp}/nope"], "--target", "no such directory")
case(
    "apply_target_not_megatron",
    "apply",
    ["--target", "{empty_dir}"],
    "megatron/training",
    "give the directory above megatron/",
)
case(
    "apply_actions_conflict",
    "apply",
    ["--reverse", "--status"],
    "--reverse conflicts with --status",
    "give one action",
)
case(
    "apply_status_dry_run", "apply", ["--status", "--dry-run"], "--dry-run conflicts with --status", "--help"
)
case("apply_python_missing", "apply", ["--python", "{tmp}/nopython"], "nopython", "use --python", rc=3)
case(
    "apply_python_not_python",
    "apply",
    ["--python", "false"],
    "could not query",
    "an interpreter that has megatron-core",
    rc=3,
)

# launch scripts: the check runs before torchrun (no rank, no elastic banner)
case("demo_hdet_arms_3", "demo", ["--hdet-arms", "3"], "--hdet-arms 3", "use one of [1, 2]")
case("demo_hdet_period_0", "demo", ["--hdet-period", "0"], "--hdet-period", "integer >= 1")
case("demo_axis_bad", "demo", ["--hdet-axis", "lr:1.5"], "--hdet-axis lr:1.5", "use spread < 1")
case(
    "demo_tp_3", "demo", ["--tensor-model-parallel-size", "3"], "world size 4", "--tensor-model-parallel-size"
)
case("demo_steps_text", "demo", [], "STEPS=abc", "expected an integer", env={"STEPS": "abc"})
case(
    "demo_run_dir_foreign",
    "demo",
    [],
    "stranger_dir is not empty and not a previous demo run",
    "pick another RUN_DIR",
    env={"RUN_DIR": "{stranger_dir}"},
)
case("demo_data_missing", "demo", ["--data-path", "{tmp}/corpus"], "corpus", "prepare_data.py")
case("multinode_arms", "multinode", ["--hdet-arms", "3"], "--hdet-arms 3", "use one of [1, 2]")
case("multinode_no_data", "multinode", [], "DATA_PATH", "MOCK=1", env={"MOCK": "0"})
case("multinode_world_tp", "multinode", [], "world size 4", "change TP/PP", env={"TP": "3"})
case("multinode_gpus_0", "multinode", [], "GPUS_PER_NODE=0", ">= 1", env={"GPUS_PER_NODE": "0"})
case("multinode_node_rank", "multinode", [], "NODE_RANK=2", "NNODES-1", env={"NODE_RANK": "2"})
case("multinode_load_damaged", "multinode", ["--load", "{ckpt_truncated}"], ".metadata", "save it again")
case("sbatch_bad_flag", "sbatch", ["--hdet-period", "-1"], "--hdet-period", "integer >= 1")
case(
    "sbatch_wrong_repo",
    "sbatch",
    [],
    "REPO=",
    "submit from the repository root",
    env={"SLURM_SUBMIT_DIR": "{tmp}"},
)
case(
    "sbatch_outside_slurm",
    "sbatch",
    [],
    "not inside a Slurm job",
    "submit it with sbatch",
    env={"SLURM_JOB_NUM_NODES": ""},
)
case("hdet_sh_no_vocab", "hdet_sh", [], "VOCAB_FILE", "MERGE_FILE", env={"DATA_PATH": "{data}"})
case("hdet_sh_tp_0", "hdet_sh", [], "TP=0", ">= 1", env={"TP": "0"})
case("hdet_sh_unpatched", "hdet_sh", [], "status: not applied", "apply.sh", rc=3)

CASES = C
IDS = [c[0] for c in CASES]


# --- inputs -------------------------------------------------------------------------------------


def _ckpt(root: Path, iteration: int, tracker: str | None = None) -> Path:
    """The file layout of a torch_dist checkpoint as megatron-core 0.19 writes it (contents are
    stand-ins: the checks read headers, not tensors)."""
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    (d / ".metadata").write_bytes(b"\x80\x04\x95stand-in")
    (d / "__0_0.distcp").write_bytes(b"\0" * 64)
    (root / "latest_checkpointed_iteration.txt").write_text(
        tracker if tracker is not None else str(iteration)
    )
    return d


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("entry")
    f = {"tmp": str(tmp)}
    (tmp / "empty").mkdir()
    f["empty_dir"] = str(tmp / "empty")
    (tmp / "a_file").write_text("x")
    f["a_file"] = str(tmp / "a_file")
    data = tmp / "data" / "corpus_text_document"
    data.parent.mkdir()
    for ext in (".bin", ".idx"):
        Path(str(data) + ext).write_bytes(b"")
    Path(str(data) + ".json").write_text(json.dumps({"tokenizer": {"type": "ByteLevel"}}))
    f["data"] = str(data)
    # hdet report inputs
    for name, content in (
        ("foreign_run", b'{"loss": 1.0, "step": 3}\n[1, 2]\n'),
        ("binary_run", b"\xff\xfe\x00garbage\x9c\n"),
        ("empty_run", b""),
    ):
        (tmp / name).mkdir()
        (tmp / name / "metrics.jsonl").write_bytes(content)
        f[name] = str(tmp / name)
    good = tmp / "good_run"
    good.mkdir()
    with open(good / "metrics.jsonl", "w") as fh:
        fh.write(json.dumps({"type": "run", "iteration": 0, "args": {}}) + "\n")
        for it in range(1, 4):
            fh.write(
                json.dumps(
                    {
                        "type": "step",
                        "iteration": it,
                        "loss": 1.0,
                        "base_lr": 1e-3,
                        "lr": 1e-3,
                        "arm_lrs": [1e-3],
                        "scale": 1.0,
                    }
                )
                + "\n"
            )
    f["good_run"] = str(good)
    # checkpoints
    bad_tracker = tmp / "ckpt_bad_tracker"
    _ckpt(bad_tracker, 10, tracker="ten\n")
    f["ckpt_bad_tracker"] = str(bad_tracker)
    dangling = tmp / "ckpt_dangling"
    _ckpt(dangling, 10, tracker="20")
    f["ckpt_dangling"] = str(dangling)
    truncated = tmp / "ckpt_truncated"
    d = _ckpt(truncated, 10)
    (d / ".metadata").write_bytes(b"")  # an interrupted save
    f["ckpt_truncated"] = str(truncated)
    bad_meta = tmp / "ckpt_bad_metadata"
    d = _ckpt(bad_meta, 10)
    (d / "metadata.json").write_text("{not json")
    f["ckpt_bad_metadata"] = str(bad_meta)
    empty_iter = tmp / "ckpt_empty_iter"
    (empty_iter / "iter_0000010").mkdir(parents=True)
    (empty_iter / "latest_checkpointed_iteration.txt").write_text("10")
    f["ckpt_empty_iter"] = str(empty_iter)
    two = tmp / "ckpt_two"  # checkpoints at 10 and 20 (the tracker names 20)
    _ckpt(two, 10)
    _ckpt(two, 20)
    f["ckpt_two"] = str(two)
    stranger = tmp / "stranger_dir"  # somebody's directory (a RUN_DIR=. or $HOME)
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    f["stranger_dir"] = str(stranger)
    (tmp / "my_plot.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # a PNG hdet report did not write
    f["foreign_png"] = str(tmp / "my_plot.png")
    legacy = tmp / "ckpt_legacy_empty"
    (legacy / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (legacy / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (legacy / "latest_checkpointed_iteration.txt").write_text("10")
    f["ckpt_legacy_empty"] = str(legacy)
    # the run directory of another job: same layout, another model
    other = tmp / "other_job"
    _ckpt(other, 10)
    with open(other / "metrics.jsonl", "w") as fh:
        args = {
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "ffn_hidden_size": 1024,
            "max_position_embeddings": 128,
            "position_embedding_type": "learned_absolute",
        }
        fh.write(json.dumps({"type": "run", "iteration": 0, "args": args}) + "\n")
    f["other_job"] = str(other)
    return f


def _fill(items, files):
    return [str(x).format(**files) for x in items]


def check_one_line(case_id, rc, out, expected_rc, needles):
    """The contract: exit code, one non-empty line naming the problem and the fix, no traceback."""
    assert "Traceback" not in out, f"{case_id}: traceback\n{out}"
    assert "ChildFailedError" not in out, f"{case_id}: torchrun banner\n{out}"
    lines = [line for line in out.splitlines() if line.strip()]
    assert rc == expected_rc, f"{case_id}: exit {rc}, expected {expected_rc}\n{out}"
    assert len(lines) == 1, f"{case_id}: {len(lines)} lines, expected 1\n{out}"
    for needle in needles:
        assert needle in lines[0], f"{case_id}: {needle!r} not in {lines[0]!r}"


# --- runners ------------------------------------------------------------------------------------


class Tripwire(Exception):
    """Validation passed: the entry point would have started work."""


def run_hdet(argv, capsys):
    from hdet_megatron.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.fixture(scope="module")
def pretrain_gpt():
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("pretrain_gpt_entry_test", EXAMPLES / "pretrain_gpt.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def run_pretrain_gpt(module, argv, capsys, monkeypatch):
    def tripwire(args):
        raise Tripwire(f"validation passed for {argv}")

    monkeypatch.setattr(module, "_init_distributed", tripwire)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    try:
        rc = module.main(argv)
    except SystemExit as exc:
        rc = exc.code
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _env(extra: dict, files) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYTHONPATH"))}
    env.update(
        PYTHON=sys.executable,
        VENV=str(Path(sys.executable).parent.parent),
        PYTHONWARNINGS="ignore",
        HDET_DATA_CACHE=str(Path(files["tmp"]) / "cache"),
    )
    env.update({k: v.format(**files) for k, v in extra.items()})
    return {k: v for k, v in env.items() if v != ""}


SCRIPTS = {
    "apply": (APPLY, {}),
    "demo": (EXAMPLES / "demo_cpu.sh", {"RUN_DIR": "{tmp}/demo_run"}),
    "multinode": (
        EXAMPLES / "run_multinode.sh",
        {
            "MOCK": "1",
            "GPUS_PER_NODE": "4",
            "TP": "2",
            "PP": "1",
            "SAVE": "{tmp}/mn",
            "BACKEND": "gloo",
            "TRANSFORMER_IMPL": "local",
        },
    ),
    "sbatch": (
        EXAMPLES / "pretrain_gpt.sbatch",
        {
            "MOCK": "1",
            "GPUS_PER_NODE": "4",
            "TP": "2",
            "PP": "1",
            "SAVE": "{tmp}/sb",
            "BACKEND": "gloo",
            "TRANSFORMER_IMPL": "local",
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": "node0",
            "SLURM_SUBMIT_DIR": str(REPO),
            "PATH": "{fakebin}:" + os.environ.get("PATH", ""),
        },
    ),
    "hdet_sh": (EXAMPLES / "pretrain_gpt_hdet.sh", {"GPUS_PER_NODE": "4"}),
}


@pytest.fixture(scope="module")
def fakebin(files):
    """``scontrol``/``srun`` stand-ins: the sbatch file's check must fail before ``srun`` runs."""
    bin_dir = Path(files["tmp"]) / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0\n")
    (bin_dir / "srun").write_text(
        "#!/bin/sh\necho 'srun started (the check should have stopped the job)'\nexit 0\n"
    )
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def run_script(entry, argv, env_extra, files):
    script, env_defaults = SCRIPTS[entry]
    env = _env({**env_defaults, **env_extra}, files)
    proc = subprocess.run(
        ["bash", str(script), *argv], capture_output=True, text=True, timeout=120, env=env, cwd=files["tmp"]
    )
    return proc.returncode, proc.stdout + proc.stderr


# --- pretrain_gpt_hdet.py: all of its cases in one subprocess -------------------------------------

_MLM_RUNNER = r"""
import contextlib, io, json, os, sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["pretrain_gpt_hdet.py"]
import pretrain_gpt_hdet as script

class Tripwire(Exception):
    pass

def tripwire(*a, **k):
    raise Tripwire("validation passed")

script.parse_and_validate_args = tripwire
cases = json.loads(sys.stdin.read())
results = {}
for case_id, argv in cases:
    buf = io.StringIO()
    sys.argv = ["pretrain_gpt_hdet.py", *argv]
    os.environ.update(WORLD_SIZE="4", RANK="0")
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            script.main()
            rc = 0
        except SystemExit as exc:
            rc = exc.code
        except Tripwire:
            rc = "passed"
    results[case_id] = [rc, buf.getvalue()]
print("RESULTS " + json.dumps(results))
"""

MLM_CPU = [
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--attention-backend",
    "local",
    "--spec",
    "local",
    "--no-persist-layer-norm",
    "--rerun-mode",
    "disabled",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--tokenizer-type",
    "NullTokenizer",
    "--mock-data",
    "--vocab-size",
    "128",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "8",
    "--lr",
    "1e-3",
]


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    """A patched copy of the installed megatron/training (as tests/test_training_patch.py)."""
    import importlib.metadata as md

    src = Path(str(md.distribution("megatron-core").locate_file("megatron/training"))).resolve()
    root = tmp_path_factory.mktemp("overlay")
    shutil.copytree(src, root / "megatron" / "training", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        ["bash", str(APPLY), "--target", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture(scope="module")
def mlm_results(overlay, files):
    cases = [(c[0], MLM_CPU + _fill(c[2], files)) for c in CASES if c[1] == "mlm"]
    cases.append(("__good__", MLM_CPU))
    # Continuing your own run: --load and --save the same directory (issue 27: not refused).
    cases.append(
        (
            "__resume__",
            MLM_CPU + ["--load", files["ckpt_two"], "--save", files["ckpt_two"], "--save-interval", "4"],
        )
    )
    env = {**os.environ, "PYTHONPATH": str(overlay), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", _MLM_RUNNER, str(EXAMPLES)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULTS ") :])


# --- the test -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_input_is_one_clear_line(case, files, capsys, monkeypatch, request):
    case_id, entry, argv, env, rc, needles = case
    argv = _fill(argv, files)
    if entry == "hdet":
        got_rc, out = run_hdet(argv, capsys)
    elif entry == "pretrain_gpt":
        got_rc, out = run_pretrain_gpt(request.getfixturevalue("pretrain_gpt"), argv, capsys, monkeypatch)
    elif entry == "mlm":
        got_rc, out = request.getfixturevalue("mlm_results")[case_id]
    else:
        if entry == "sbatch":
            files = {**files, "fakebin": request.getfixturevalue("fakebin")}
        got_rc, out = run_script(entry, argv, env, files)
        assert "srun started" not in out
    check_one_line(case_id, got_rc, out, rc, needles)


def test_the_table_is_big_enough():
    entries = {c[1] for c in CASES}
    assert entries == {"hdet", "pretrain_gpt", "mlm", "apply", "demo", "multinode", "sbatch", "hdet_sh"}
    assert len(CASES) >= 40 and len(set(IDS)) == len(IDS)


def test_good_megatron_flags_pass_the_check(mlm_results):
    """The Megatron-LM check is not refusing everything: the base flags pass it."""
    assert mlm_results["__good__"][0] == "passed", mlm_results["__good__"]
    assert mlm_results["__resume__"][0] == "passed", mlm_results["__resume__"]


def test_case_count_matches_the_docs():
    """README and docs/troubleshooting.md quote how many bad inputs this table tries."""
    n = len(CASES)
    readme = (REPO / "README.md").read_text()
    assert re.search(rf"\b{n} bad inputs\b", readme), f"README: update the count to {n} bad inputs"
    docs = REPO / "docs" / "troubleshooting.md"
    assert re.search(rf"\b{n} bad inputs\b", docs.read_text()), f"{docs}: update the count to {n}"


# --- the launchers' defaults give way to the user's flags ---------------------------------------


@pytest.mark.parametrize(
    "user, dropped, kept",
    [
        (["--hdet-axis", "lr:0.3"], ["--hdet-spread"], ["--hdet-period"]),
        (["--hdet-spread", "0.3"], [], ["--hdet-period"]),
        (["--no-hdet"], ["--hdet-spread", "--hdet-period"], ["--lr"]),
        (["--mock-data"], ["--data-path", "--split"], ["--lr"]),
        (["--lr=0.1"], ["--lr"], ["--data-path"]),
        (["--lr-warmup-fraction", "0.1"], ["--lr-warmup-iters"], ["--lr"]),
    ],
)
def test_user_flags_replace_launcher_defaults(user, dropped, kept):
    from hdet_megatron.preflight import merge_defaults

    defaults = [
        "--lr",
        "2e-3",
        "--lr-warmup-iters",
        "30",
        "--data-path",
        "w1",
        "p1",
        "--split",
        "90,5,5",
        "--hdet-period",
        "25",
        "--hdet-spread",
        "0.2",
    ]
    merged = merge_defaults(defaults, user)
    assert merged[len(merged) - len(user) :] == user
    head = merged[: len(merged) - len(user)]
    for flag in dropped:
        assert flag not in head
    for flag in kept:
        assert flag in head
    if "--data-path" in head:  # a multi-value default keeps all its values
        i = head.index("--data-path")
        assert head[i + 1 : i + 3] == ["w1", "p1"]


def test_demo_accepts_an_explicit_axis(files, capsys, monkeypatch):
    """The issue's example: `demo_cpu.sh --hdet-axis lr:0.3` passes the check (the demo's
    --hdet-spread default gives way) and the merged command line has no --hdet-spread."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import check_args
    finally:
        sys.path.remove(str(EXAMPLES))
    monkeypatch.setenv("HDET_DATA_CACHE", str(Path(files["tmp"]) / "cache"))
    demo_defaults = [
        "--tensor-model-parallel-size",
        "2",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--data-path",
        "@default-corpus",
        "--save",
        str(Path(files["tmp"]) / "demo_ok"),
        "--hdet-period",
        "25",
        "--hdet-spread",
        "0.2",
    ]
    rc = check_args.main(
        [
            "--world-size",
            "4",
            "--fresh",
            "--print0",
            "--defaults",
            str(len(demo_defaults)),
            "--",
            *demo_defaults,
            "--hdet-axis",
            "lr:0.3",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    merged = out.split("\0")[:-1]
    assert "--hdet-spread" not in merged and merged[-2:] == ["--hdet-axis", "lr:0.3"]
    assert "@default-corpus" in merged  # prepared by the demo only after the check passed
