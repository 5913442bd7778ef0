"""pretrain_gpt.py's command-line flags (Megatron-LM style plus --hdet-*) and every check that needs
no process group."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from hdet_megatron.args import add_hdet_args, hdet_config_from_args
from hdet_megatron.config import HDETConfigError, short_run_caution

PROG = "pretrain_gpt.py"
DESCRIPTION = "GPT pretraining on Megatron-Core with HDET (Hyperparameter-Divergent Ensemble Training)."
DOCUMENT_SUFFIX = "_text_document"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker file


class UsageError(ValueError):
    """Bad flags or inputs; the message says what is wrong and what to do."""


# ==============================================================================================
# Arguments
# ==============================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=128, help="hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP size (default 4 x hidden)")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="position table size (default: --seq-length)",
    )
    g.add_argument(
        "--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute"
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x TP",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output layer (default: tied to the input embedding)",
    )
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="layer spec: Megatron-Core local modules or Transformer Engine (GPU)",
    )

    g.add_argument(
        "--num-experts", type=int, default=None, help="mixture of experts: experts per MLP (default: dense)"
    )
    g.add_argument("--moe-router-topk", type=int, default=2, help="MoE: experts per token")
    g.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall"),
        default="allgather",
        help="MoE: how tokens reach the experts' ranks",
    )

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="split each sequence over this many ranks (needs --transformer-impl transformer_engine)",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="MoE: split the experts over this many ranks",
    )
    g.add_argument(
        "--expert-tensor-parallel-size", type=int, default=None, help="MoE: TP of the experts (default: TP)"
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (TP > 1; TP x EP needs it)",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="ZeRO-1 distributed optimizer (with HDET: one instance per arm)",
    )
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument(
        "--distributed-backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl on CUDA, gloo on CPU",
    )
    g.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: cuda when available (cpu with --distributed-backend gloo). "
        "cuda with gloo runs several ranks on one GPU (NCCL refuses that); each "
        "rank uses GPU LOCAL_RANK %% device count",
    )
    g.add_argument(
        "--distributed-timeout-minutes", type=int, default=10, help="collective timeout (process group)"
    )
    g.add_argument(
        "--node-timeout",
        type=float,
        default=60.0,
        help="multi-node: seconds without an answer from another node before every node "
        "stops, naming the lost one (a dead node's gone processes are seen within "
        "2 pings, timeout/10 s apart); 0 = off (hdet_megatron/liveness.py)",
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per iteration (default: micro-batch-size x DP)",
    )
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)",
    )
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("evaluation")
    g.add_argument(
        "--eval-interval", type=int, default=1000, help="iterations between validation runs (also at the end)"
    )
    g.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="validation iterations (global batches) per evaluation; 0 = none",
    )

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument(
        "--save-interval", type=int, default=None, help="iterations between saves (and at the end)"
    )
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument(
        "--ckpt-format",
        choices=("torch_dist", "torch"),
        default="torch_dist",
        help="dist_checkpointing (sharded) or legacy per-rank torch.save files",
    )
    g.add_argument(
        "--override-opt-param-scheduler",
        action="store_true",
        help="on --load, this run's LR schedule and HDET config win over the checkpoint's",
    )
    g.add_argument(
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="on --load, the checkpoint's LR schedule and HDET config win (the default)",
    )
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="with --load: stop if there is no checkpoint (default: start from scratch)",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="indexed dataset prefix(es): PREFIX or W1 PREFIX1 W2 PREFIX2 ...",
    )
    g.add_argument("--mock-data", action="store_true", help="Megatron's synthetic MockGPTDataset")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights (by documents)")
    g.add_argument(
        "--tokenizer-type",
        default=None,
        choices=("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer"),
        help="default: what the data was prepared with (ByteLevel)",
    )
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary of --mock-data (default 257)")
    g.add_argument(
        "--data-cache-path", default=None, help="where GPTDataset index caches go (default: next to the data)"
    )

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument(
        "--run-dir",
        default=None,
        help="metrics.jsonl and TensorBoard events (default: --save, else runs/<time>)",
    )
    g.add_argument(
        "--tensorboard-dir",
        default=None,
        help="TensorBoard events (default RUN_DIR/tensorboard if tensorboard is installed)",
    )
    g.add_argument("--no-tensorboard", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no per-interval progress lines")

    add_hdet_args(p)
    return p


def _explicit_hdet_flags(argv: list[str]) -> list[str]:
    flags = []
    for token in argv:
        name = token.split("=", 1)[0]
        if name.startswith(("--hdet-", "--no-hdet-")):
            flags.append(name)
    return flags


def _data_prefixes(data_path: list[str]) -> list[str]:
    if len(data_path) > 1 and len(data_path) % 2 == 0:
        try:
            [float(w) for w in data_path[0::2]]
            return data_path[1::2]
        except ValueError:
            pass
    return data_path


def parse_args(argv: list[str] | None = None, world_size: int | None = None):
    """Parse and validate. Returns ``(args, hdet_config_or_None)``; raises :class:`UsageError`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()

    def error(message):  # argparse errors become UsageError (clear message, no traceback)
        raise UsageError(f"{message} ({PROG} --help lists the flags)")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    hdet = validate_args(args, argv, world)
    return args, hdet


def validate_args(args, argv: list[str], world_size: int):
    """Every check that needs no process group; fills derived values into ``args``."""
    check_device(args)

    # Conflicting flags.
    if not args.hdet:
        explicit = _explicit_hdet_flags(argv)
        if explicit:
            raise UsageError(
                f"--no-hdet conflicts with {', '.join(sorted(set(explicit)))}: drop --no-hdet to "
                "train with HDET, or drop the --hdet-* flags for plain Megatron"
            )
    if args.mock_data and args.data_path:
        raise UsageError("--mock-data conflicts with --data-path: give one of them")
    if not args.mock_data and not args.data_path:
        raise UsageError(
            "missing data path: give --data-path PREFIX (an indexed dataset from "
            "examples/pretrain_gpt/prepare_data.py, e.g. --data-path my_corpus_text_document) or "
            "--mock-data for synthetic tokens"
        )
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise UsageError("--lr-warmup-fraction conflicts with --lr-warmup-iters: give one of them")
    if args.ckpt_step is not None and not args.load:
        raise UsageError("--ckpt-step needs --load DIR")
    if args.save_interval is not None and not args.save:
        raise UsageError("--save-interval needs --save DIR")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UsageError("--override-opt-param-scheduler conflicts with --use-checkpoint-opt-param-scheduler")
    if args.no_tensorboard and args.tensorboard_dir:
        raise UsageError("--no-tensorboard conflicts with --tensorboard-dir")
    if args.mock_data and (
        args.tokenizer_type not in (None, "ByteLevel")
        or args.vocab_file
        or args.merge_file
        or args.tokenizer_model
    ):
        raise UsageError("--mock-data uses synthetic token ids: drop the tokenizer flags (use --vocab-size)")
    if args.vocab_size is not None and not args.mock_data:
        raise UsageError("--vocab-size is for --mock-data; real data takes its vocabulary from the tokenizer")

    # Sizes.
    positive = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "log_interval",
        "eval_interval",
        "make_vocab_size_divisible_by",
    )
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_iters < 0:
        raise UsageError("--eval-iters must be >= 0")
    if args.node_timeout < 0:
        raise UsageError(f"--node-timeout must be >= 0 (0 = off), got {args.node_timeout}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise UsageError(
            f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}: "
            "launch a multiple of TP x PP processes (torchrun --nproc-per-node ...) or change "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size"
        )
    _check_moe_and_cp(args, world_size)
    dp = world_size // (tp * pp * args.context_parallel_size)
    args.world_size, args.data_parallel_size = world_size, dp
    if args.num_layers % pp:
        raise UsageError(f"--num-layers {args.num_layers} is not divisible by PP {pp}")
    if args.num_attention_heads % tp:
        raise UsageError(f"--num-attention-heads {args.num_attention_heads} is not divisible by TP {tp}")
    if args.hidden_size % args.num_attention_heads:
        raise UsageError(
            f"--hidden-size {args.hidden_size} is not divisible by "
            f"--num-attention-heads {args.num_attention_heads}"
        )
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size x "
            f"DP = {args.micro_batch_size} x {dp}"
        )
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if pp > 1 and args.num_microbatches < pp:
        print(
            f"{PROG}: note: {args.num_microbatches} microbatches for PP {pp} leave pipeline bubbles",
            file=sys.stderr,
        )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise UsageError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}"
        )
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1)")

    # Schedule.
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise UsageError(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr}) and --lr > 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise UsageError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the decay iterations "
            f"({args.lr_decay_iters})"
        )

    # Data.
    if args.data_path:
        for prefix in _data_prefixes(args.data_path):
            missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
            if missing:
                hint = ""
                if os.path.isfile(prefix + DOCUMENT_SUFFIX + ".bin"):
                    hint = f" (did you mean --data-path {prefix + DOCUMENT_SUFFIX}?)"
                raise UsageError(
                    f"data path {prefix!r} not found: missing {', '.join(missing)}{hint}. Prepare a "
                    "corpus with examples/pretrain_gpt/prepare_data.py --input FILES "
                    "--output-prefix PREFIX, then pass --data-path PREFIX_text_document"
                )
            meta_path = prefix + ".json"
            if os.path.isfile(meta_path):
                with open(meta_path) as fh:
                    prepared = json.load(fh).get("tokenizer", {}).get("type")
                if args.tokenizer_type is None:
                    args.tokenizer_type = prepared
                elif prepared and prepared != args.tokenizer_type:
                    raise UsageError(
                        f"{prefix} was prepared with the {prepared} tokenizer, but "
                        f"--tokenizer-type {args.tokenizer_type} was given; they must match"
                    )
    if args.tokenizer_type is None:
        args.tokenizer_type = "ByteLevel"

    # Checkpoints.
    _check_files(args)
    if args.load and args.exit_on_missing_checkpoint and not _checkpoint_iteration(args.load, args.ckpt_step):
        raise UsageError(f"--load {args.load}: no checkpoint found (--exit-on-missing-checkpoint)")
    if args.load and args.ckpt_step is not None and not _checkpoint_iteration(args.load, args.ckpt_step):
        raise UsageError(f"--load {args.load} --ckpt-step {args.ckpt_step}: no such checkpoint directory")

    # HDET.
    try:
        hdet = hdet_config_from_args(args)
    except HDETConfigError as exc:
        raise UsageError(str(exc)) from None
    if hdet is not None:
        cp, ep = args.context_parallel_size, args.expert_model_parallel_size
        # An arm must hold whole expert groups (HDET's ArmLayout checks the real groups again):
        # in megatron-core's order tp-cp-ep-dp-pp a replica is TP x CP consecutive ranks of a
        # stage and an expert group expert-TP x EP of them, spanning this many replicas.
        span = max(1, ep * (args.expert_tensor_parallel_size or tp) // (tp * cp)) if args.num_experts else 1
        valid = [a for a in range(1, dp + 1) if dp % a == 0 and (dp // a) % span == 0]
        arms = hdet.arms or valid[-1]
        if dp % arms:
            raise UsageError(
                f"--hdet-arms {arms} must divide the data-parallel size {dp} "
                f"(world {world_size} / TP {tp} / CP {cp} / PP {pp}); use one of "
                f"{[a for a in range(1, dp + 1) if dp % a == 0]}"
            )
        if arms not in valid:
            raise UsageError(
                f"--hdet-arms {arms} splits expert-parallel groups (EP {ep}): an arm must hold whole "
                f"expert groups; use one of {valid}"
            )
        if hdet.arms is None and valid[-1] == 1 and dp > 1:
            raise UsageError(
                f"HDET cannot place arms: every expert-parallel group (EP {ep}) spans all {dp} "
                "data-parallel replicas; lower --expert-model-parallel-size or add replicas"
            )
        args.hdet_num_arms = arms
        # This script always supplies a probe (batches no arm trained on), so "auto" fields take
        # the probe defaults (HDETConfig.resolve); the header prints what was chosen.
        resolution = hdet.resolve(probe_available=True, num_arms=arms)
        hdet, args.hdet_defaults_note = resolution.config, resolution.note
        args.hdet_short_run_note = short_run_caution(hdet, args.train_iters)
        if args.eval_iters and args.eval_interval % hdet.period:
            print(
                f"{PROG}: note: --eval-interval {args.eval_interval} is not a multiple of "
                f"--hdet-period {hdet.period}: validation then sees each arm's own (diverged) "
                "model; at multiples of the period it sees the averaged model",
                file=sys.stderr,
            )
    else:
        args.hdet_num_arms = 1
    if args.run_dir is None:
        args.run_dir = args.save or os.path.join(
            "runs", datetime.datetime.now().strftime("gpt-%Y%m%d-%H%M%S")
        )
    return hdet


def _check_moe_and_cp(args, world_size: int) -> None:
    """Mixture-of-experts and context-parallel flags: one line per bad combination."""
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    for name in ("context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if world_size % (tp * cp * pp):
        raise UsageError(
            f"world size {world_size} is not divisible by TP x CP x PP = {tp} x {cp} x {pp}: change "
            "--context-parallel-size or the number of processes"
        )
    if cp > 1:
        if args.transformer_impl != "transformer_engine":
            raise UsageError(
                "--context-parallel-size > 1 needs Transformer Engine's attention: add "
                "--transformer-impl transformer_engine (GPU); Megatron's local attention has no CP"
            )
        if args.seq_length % (2 * cp):
            raise UsageError(f"--seq-length {args.seq_length} must be divisible by 2 x CP = {2 * cp}")
    if args.sequence_parallel and tp == 1:
        raise UsageError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_experts is None:
        if ep > 1 or etp is not None:
            raise UsageError(
                "--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts"
            )
        return
    if args.num_experts < 1 or args.num_experts % ep:
        raise UsageError(f"--num-experts {args.num_experts} must be a positive multiple of EP {ep}")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise UsageError(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts]")
    expert_mp = ep * (etp or tp)
    if (world_size // pp) % expert_mp:
        raise UsageError(
            f"EP x expert TP = {ep} x {etp or tp} does not divide the {world_size // pp} ranks of a "
            "pipeline stage: change --expert-model-parallel-size / --expert-tensor-parallel-size"
        )
    if ep > 1 and tp > 1 and not args.sequence_parallel:
        raise UsageError("MoE with EP > 1 and TP > 1 needs --sequence-parallel (Megatron requires it)")


def _check_files(args) -> None:
    """A readable checkpoint in --load, no directory of another job, no other run's checkpoints
    in --save, and no other program's metrics.jsonl where the records go (hdet_megatron.preflight)."""
    from hdet_megatron import preflight

    try:
        if args.load:
            preflight.check_checkpoint(args.load, args.ckpt_step)
        for flag, path in (
            ("--load", args.load),
            ("--save", args.save),
            ("--run-dir", args.run_dir or args.save),
        ):
            if path:
                preflight.check_run_dir(path, args, flag)
        if args.save:
            preflight.check_save_dir(args.save, args.load, args.ckpt_step)
        if args.run_dir or args.save:
            flag = "--run-dir" if args.run_dir else "--save"
            preflight.check_metrics_file(args.run_dir or args.save, flag, args.save)
    except preflight.InputError as exc:
        raise UsageError(str(exc)) from None


def resolve_device(args) -> str:
    """``cuda`` or ``cpu`` from ``--device`` / ``--distributed-backend`` and what is there."""
    import torch

    if args.device != "auto":
        return args.device
    return "cuda" if torch.cuda.is_available() and args.distributed_backend != "gloo" else "cpu"


def check_device(args) -> None:
    """Device, backend and layer-spec flags that cannot work on this machine. Imports torch only
    for the flags that need it (the launchers' pre-torchrun check stays fast in the default case)."""
    import importlib.util

    if not (
        args.device == "cuda"
        or args.distributed_backend == "nccl"
        or args.transformer_impl == "transformer_engine"
    ):
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: no CUDA device is available here (torch.cuda.is_available() "
            "is False); use --device cpu (gloo)"
        )
    device = resolve_device(args)
    if device == "cpu" and args.distributed_backend == "nccl":
        raise UsageError("--distributed-backend nccl needs CUDA tensors: use gloo on CPU, or --device cuda")
    if args.transformer_impl == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            raise UsageError(
                "--transformer-impl transformer_engine needs NVIDIA Transformer Engine, which is not "
                "installed in this Python: use an NGC PyTorch image (docker/) or install "
                "transformer-engine[pytorch], or train with --transformer-impl local"
            )
        if device != "cuda":
            raise UsageError(
                "--transformer-impl transformer_engine runs on CUDA only; this run would use the CPU "
                f"({'no CUDA device here' if not torch.cuda.is_available() else '--device cpu / gloo'}): "
                "use --transformer-impl local on CPU"
            )


def _checkpoint_iteration(load_dir: str, ckpt_step: int | None = None) -> int | None:
    if ckpt_step is not None:
        return ckpt_step if os.path.isdir(os.path.join(load_dir, f"iter_{ckpt_step:07d}")) else None
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{tracker}: expected an iteration number, found {text[:40]!r}") from None


# ==============================================================================================
