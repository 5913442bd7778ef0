"""examples/pretrain_gpt/pretrain_gpt.py: flags, derived values and clear errors for bad input.

No process group and no megatron import: everything here is checked before training starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from hdet_megatron.config import HDETConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"


@pytest.fixture(scope="module")
def pg():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def data(tmp_path):
    """A fake prepared dataset (existence and sidecar are all the flag checks look at)."""
    prefix = tmp_path / "corpus_text_document"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")
    (tmp_path / "corpus_text_document.json").write_text(json.dumps({"tokenizer": {"type": "ByteLevel"}}))
    return str(prefix)


def parse(pg, argv, world=4):
    return pg.parse_args(argv, world_size=world)


def test_defaults_and_derived_values(pg, data):
    args, hdet = parse(
        pg,
        [
            "--data-path",
            data,
            "--tensor-model-parallel-size",
            "2",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
        ],
    )
    assert args.data_parallel_size == 2 and args.num_microbatches == 2
    assert args.tokenizer_type == "ByteLevel"  # taken from the dataset's sidecar
    assert args.max_position_embeddings == args.seq_length and args.ffn_hidden_size == 4 * args.hidden_size
    assert args.lr_decay_iters == args.train_iters
    # Every HDET default comes from HDETConfig, resolved for this script (it always has a probe).
    assert hdet == HDETConfig().resolve(probe_available=True, num_arms=2).config
    assert hdet.signal == "train" and "needs >= 3 arms" in args.hdet_defaults_note  # DP 2: 2 arms
    assert args.hdet_num_arms == 2
    args, hdet = parse(pg, ["--mock-data", "--no-hdet"])
    assert hdet is None and args.hdet_num_arms == 1 and args.global_batch_size == 4 * 4
    # 4 arms: the slow start; 100 iterations are 5 windows of 20, too few to climb (one line says so).
    args, hdet = parse(pg, ["--data-path", data, "--train-iters", "100", "--hdet-period", "20"])
    assert hdet.start_scale == 0.25 and "only 5 windows of 20" in args.hdet_short_run_note
    args, hdet = parse(pg, ["--data-path", data, "--train-iters", "400", "--hdet-period", "20"])
    assert args.hdet_short_run_note == ""


def test_hdet_flags_cover_every_config_field(pg, data):
    argv = [
        "--data-path",
        data,
        "--hdet-period",
        "7",
        "--hdet-arms",
        "2",
        "--hdet-grad-sync",
        "arm",
        "--hdet-axis",
        "lr:0.3",
        "--hdet-axis",
        "weight_decay:0.5:0:1",
        "--hdet-spread-kind",
        "log",
        "--no-hdet-auto",
        "--hdet-auto-start",
        "5",
        "--hdet-temperature",
        "auto",
        "--hdet-meta-lr",
        "0.2",
        "--hdet-momentum",
        "0.5",
        "--hdet-scale-bounds",
        "0.1",
        "10",
        "--hdet-rule",
        "paper",
        "--hdet-seed",
        "3",
        "--hdet-bucket-mb",
        "8",
        "--no-hdet-home-main-params",
        "--no-hdet-converge-on-save",
        "--hdet-nonfinite",
        "raise",
        "--hdet-rollback",
        "--hdet-signal",
        "probe",
        "--hdet-start-scale",
        "0.5",
        "--no-hdet-brake",
        "--hdet-brake-factor",
        "0.3",
        "--hdet-brake-spike",
        "0.5",
        "--hdet-brake-rise",
        "0.3",
        "--hdet-brake-hold",
        "4",
        "--no-hdet-noise-aware",
        "--no-hdet-warmup-hold",
    ]
    _, hdet = parse(pg, argv)
    # Every setting has a flag (resolution_note, compare=False, is what resolve() chose, not a setting).
    settings = [f for f in dataclasses.fields(HDETConfig) if f.compare]
    changed = {f.name for f in settings if getattr(hdet, f.name) != getattr(HDETConfig(), f.name)}
    # line_width needs a line signal, which two axes and arm-local gradients rule out: its own run.
    assert changed == {f.name for f in settings} - {"line_width"}
    assert len(settings) == len(dataclasses.fields(HDETConfig)) - 1
    assert hdet.period == 7 and hdet.axes[0].kind == "log" and hdet.scale_bounds == (0.1, 10.0)
    _, wide = parse(pg, ["--data-path", data, "--hdet-spread", "0.05", "--hdet-line-width", "0.3"])
    assert wide.line_width == 0.3 and wide.axes[0].spread == 0.05


@pytest.mark.parametrize(
    "argv, world, needle",
    [
        ([], 4, "missing data path: give --data-path"),
        (["--data-path", "/nonexistent/corpus"], 4, "data path '/nonexistent/corpus' not found: missing"),
        (
            ["--mock-data", "--tensor-model-parallel-size", "3"],
            4,
            "world size 4 is not divisible by TP x PP = 3 x 1 = 3",
        ),
        (
            ["--mock-data", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            6,
            "world size 6 is not divisible by TP x PP = 2 x 2 = 4",
        ),
        (["--mock-data", "--no-hdet", "--hdet-period", "5"], 4, "--no-hdet conflicts with --hdet-period"),
        (["--mock-data", "--no-hdet", "--hdet-spread=0.2"], 4, "--no-hdet conflicts with --hdet-spread"),
        (["--mock-data", "--data-path", "x"], 4, "--mock-data conflicts with --data-path"),
        (
            ["--mock-data", "--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"],
            4,
            "--lr-warmup-fraction conflicts with --lr-warmup-iters",
        ),
        (
            ["--mock-data", "--hdet-spread", "0.2", "--hdet-axis", "lr:0.1"],
            4,
            "--hdet-spread and --hdet-axis conflict",
        ),
        (["--mock-data", "--hdet-arms", "3"], 4, "--hdet-arms 3 must divide the data-parallel size 4"),
        (
            ["--mock-data", "--micro-batch-size", "3", "--global-batch-size", "8"],
            4,
            "--global-batch-size 8 is not divisible by micro-batch-size x DP = 3 x 4",
        ),
        (
            ["--mock-data", "--seq-length", "512", "--max-position-embeddings", "256"],
            4,
            "--seq-length 512 exceeds --max-position-embeddings 256",
        ),
        (
            ["--mock-data", "--num-layers", "3", "--pipeline-model-parallel-size", "2"],
            4,
            "--num-layers 3 is not divisible by PP 2",
        ),
        (["--mock-data", "--save-interval", "10"], 4, "--save-interval needs --save"),
        (["--mock-data", "--ckpt-step", "10"], 4, "--ckpt-step needs --load"),
        (["--mock-data", "--lr-warmup-iters", "300"], 4, "--lr-warmup-iters 300 must be smaller"),
        (["--mock-data", "--hdet-period", "0"], 4, "HDETConfig.period=0"),
        (["--mock-data", "--hdet-axis", "lr"], 4, "--hdet-axis 'lr': expected NAME:SPREAD"),
        (["--mock-data", "--bogus-flag"], 4, "unrecognized arguments: --bogus-flag"),
        (["--mock-data", "--tokenizer-type", "GPT2BPETokenizer"], 4, "--mock-data uses synthetic token ids"),
        # Mixture of experts and context parallelism (issue 26).
        (
            ["--mock-data", "--num-experts", "4", "--expert-model-parallel-size", "2", "--hdet-arms", "4"],
            4,
            "--hdet-arms 4 splits expert-parallel groups (EP 2): an arm must hold whole expert groups; "
            "use one of [1, 2]",
        ),
        (
            ["--mock-data", "--num-experts", "4", "--expert-model-parallel-size", "4"],
            4,
            "HDET cannot place arms: every expert-parallel group (EP 4) spans all 4",
        ),
        (["--mock-data", "--expert-model-parallel-size", "2"], 4, "need --num-experts"),
        (
            ["--mock-data", "--num-experts", "3", "--expert-model-parallel-size", "2"],
            4,
            "--num-experts 3 must be a positive multiple of EP 2",
        ),
        (
            ["--mock-data", "--num-experts", "4", "--moe-router-topk", "5"],
            4,
            "--moe-router-topk 5 must be in [1, --num-experts]",
        ),
        (
            [
                "--mock-data",
                "--num-experts",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
            ],
            4,
            "MoE with EP > 1 and TP > 1 needs --sequence-parallel",
        ),
        (
            ["--mock-data", "--sequence-parallel"],
            4,
            "--sequence-parallel needs --tensor-model-parallel-size > 1",
        ),
        (
            ["--mock-data", "--context-parallel-size", "2"],
            4,
            "--context-parallel-size > 1 needs Transformer Engine",
        ),
        (["--mock-data", "--context-parallel-size", "3"], 4, "not divisible by TP x CP x PP = 1 x 3 x 1"),
    ],
)
def test_bad_input_is_a_clear_error(pg, argv, world, needle):
    with pytest.raises(pg.UsageError) as info:
        parse(pg, argv, world)
    assert needle in str(info.value)


def test_moe_and_cp_flags_choose_arms_that_keep_expert_groups_whole(pg):
    # DP4 EP2: the default is 2 arms (4 would split EP groups); without EP one per replica.
    args, hdet = parse(pg, ["--mock-data", "--num-experts", "4", "--expert-model-parallel-size", "2"])
    assert hdet is not None and args.hdet_num_arms == 2 and args.data_parallel_size == 4
    args, _ = parse(pg, ["--mock-data", "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall"])
    assert args.hdet_num_arms == 4 and args.moe_token_dispatcher_type == "alltoall"


def test_data_path_hint_and_tokenizer_mismatch(pg, data):
    with pytest.raises(pg.UsageError, match="did you mean --data-path .*corpus_text_document"):
        parse(pg, ["--data-path", data[: -len("_text_document")]])
    with pytest.raises(
        pg.UsageError, match="prepared with the ByteLevel tokenizer, but --tokenizer-type GPT2BPETokenizer"
    ):
        parse(pg, ["--data-path", data, "--tokenizer-type", "GPT2BPETokenizer"])


def test_main_prints_error_and_returns_2(pg, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert pg.main(["--tensor-model-parallel-size", "3", "--mock-data"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: error: world size 4 is not divisible by TP x PP")
    assert "Traceback" not in err
    monkeypatch.setenv("RANK", "1")  # other ranks stay silent (one message per job)
    assert pg.main(["--tensor-model-parallel-size", "3", "--mock-data"]) == 2
    assert capsys.readouterr().err == ""


def test_save_may_continue_only_its_own_checkpoints(tmp_path):
    """--save DIR with checkpoints: refused unless --load DIR continues them (issue 27); the
    refusals' lines are in tests/test_entry_points.py."""
    from hdet_megatron.preflight import InputError, check_save_dir, fresh_run_dir

    run = tmp_path / "run"
    for it in (4, 8):
        (run / f"iter_{it:07d}").mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text("8")
    (tmp_path / "alias").symlink_to(run)
    check_save_dir(str(tmp_path / "new"), None)  # nothing there yet
    check_save_dir(str(run), str(run))  # continue from the latest
    check_save_dir(str(run), str(tmp_path / "alias"))  # the same directory by another name
    check_save_dir(str(run), str(run), ckpt_step=8)
    for load, step in ((None, None), (str(tmp_path / "other"), None), (str(run), 4)):
        with pytest.raises(InputError):
            check_save_dir(str(run), load, ckpt_step=step)
    with fresh_run_dir():  # the demo clears --save itself first
        check_save_dir(str(run), None)
    assert sorted(p.name for p in run.iterdir()) == [
        "iter_0000004",
        "iter_0000008",
        "latest_checkpointed_iteration.txt",
    ]


def test_metrics_of_another_program_are_not_appended_to(tmp_path):
    """The run appends to RUN_DIR/metrics.jsonl: a file there with no HDET run record (another
    program's) is refused and left as it was; an empty one, or an HDET run's, is continued."""
    from hdet_megatron.preflight import InputError, check_metrics_file, fresh_run_dir

    check_metrics_file(str(tmp_path / "new"))
    (tmp_path / "metrics.jsonl").write_text("")
    check_metrics_file(str(tmp_path))  # empty (a run that died before its first record)
    (tmp_path / "metrics.jsonl").write_text('{"type": "run", "iteration": 0}\n{"type": "step"}\n')
    check_metrics_file(str(tmp_path))
    theirs = '{"epoch": 1, "accuracy": 0.93}\n'
    (tmp_path / "metrics.jsonl").write_text(theirs)
    with pytest.raises(InputError) as info:
        check_metrics_file(str(tmp_path), "--save")
    assert str(info.value) == (
        f"--save {tmp_path}: {tmp_path}/metrics.jsonl holds no HDET metrics records (another "
        "program's file?) and this run would append to it: use another --save, or move that file away"
    )
    with fresh_run_dir():  # the demo clears its RUN_DIR (= --save) first; a --run-dir elsewhere is kept
        check_metrics_file(str(tmp_path), "--save", str(tmp_path))
        with pytest.raises(InputError):
            check_metrics_file(str(tmp_path), "--run-dir", str(tmp_path / "cleared"))
    assert (tmp_path / "metrics.jsonl").read_text() == theirs
