"""GPT pretraining on Megatron-Core with HDET (Hyperparameter-Divergent Ensemble Training).

Megatron-LM style flags; runs under ``torchrun`` (gloo on CPU, NCCL on GPUs), TP x PP x DP from
the flags, data from Megatron indexed datasets (``prepare_data.py``) through ``GPTDataset`` /
``BlendedMegatronDatasetBuilder``. ``--no-hdet`` trains plain Megatron.

    torchrun --standalone --nproc-per-node 4 examples/pretrain_gpt/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 8 \\
        --train-iters 300 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 \\
        --data-path .hdet-cache/data/stdlib-py311-XXXX_text_document --split 90,5,5 \\
        --eval-interval 100 --eval-iters 10 --save runs/demo --hdet-period 25

Outputs in ``--run-dir`` (default: ``--save``, else ``runs/<timestamp>``): ``metrics.jsonl``
(per step, per window, validation; see ``hdet_megatron.metrics``), TensorBoard events when
``tensorboard`` is installed; ``hdet report RUN_DIR`` plots them. Checkpoints
(``hdet_megatron.megatron.checkpointing``): ``--save DIR`` -> ``DIR/iter_0000300/``
(``megatron.core.dist_checkpointing``, torch_dist; converged first) and
``DIR/latest_checkpointed_iteration.txt``; ``--load DIR`` resumes (model, optimizer, scheduler
incl. HDET controller state, data position, RNG).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import sys
import time
from typing import Any, Optional

_PROCESS_START = time.time()

from hdet_megatron.args import add_hdet_args, hdet_config_from_args
from hdet_megatron.config import HDETConfigError

PROG = "pretrain_gpt.py"
DOCUMENT_SUFFIX = "_text_document"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker file


class UsageError(ValueError):
    """Bad flags or inputs; the message says what is wrong and what to do."""


# ==============================================================================================
# Arguments
# ==============================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=128, help="hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP size (default 4 x hidden)")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="position table size (default: --seq-length)")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (default: tied to the input embedding)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="layer spec: Megatron-Core local modules or Transformer Engine (GPU)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1 distributed optimizer (with HDET: one instance per arm)")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=None,
                   help="default: nccl with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration (default: micro-batch-size x DP)")
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=("exponential", "linear", "cosine", "minus_sqrt"))
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="iterations between validation runs (also at the end)")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="validation iterations (global batches) per evaluation; 0 = none")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves (and at the end)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist",
                   help="dist_checkpointing (sharded) or legacy per-rank torch.save files")
    g.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="on --load, this run's LR schedule and HDET config win over the checkpoint's")
    g.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                   help="on --load, the checkpoint's LR schedule and HDET config win (the default)")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop if there is no checkpoint (default: start from scratch)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix(es): PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--mock-data", action="store_true", help="Megatron's synthetic MockGPTDataset")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights (by documents)")
    g.add_argument("--tokenizer-type", default=None,
                   choices=("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer"),
                   help="default: what the data was prepared with (ByteLevel)")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary of --mock-data (default 257)")
    g.add_argument("--data-cache-path", default=None,
                   help="where GPTDataset index caches go (default: next to the data)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--run-dir", default=None,
                   help="metrics.jsonl and TensorBoard events (default: --save, else runs/<time>)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard events (default RUN_DIR/tensorboard if tensorboard is installed)")
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


def parse_args(argv: Optional[list[str]] = None, world_size: Optional[int] = None):
    """Parse and validate. Returns ``(args, hdet_config_or_None)``; raises :class:`UsageError`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()

    def error(message):  # argparse errors become UsageError (clear message, no traceback)
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    hdet = validate_args(args, argv, world)
    return args, hdet


def validate_args(args, argv: list[str], world_size: int):
    """Every check that needs no process group; fills derived values into ``args``."""
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
    if args.mock_data and (args.tokenizer_type not in (None, "ByteLevel") or args.vocab_file
                           or args.merge_file or args.tokenizer_model):
        raise UsageError("--mock-data uses synthetic token ids: drop the tokenizer flags (use --vocab-size)")
    if args.vocab_size is not None and not args.mock_data:
        raise UsageError("--vocab-size is for --mock-data; real data takes its vocabulary from the tokenizer")

    # Sizes.
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "log_interval", "eval_interval", "make_vocab_size_divisible_by")
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_iters < 0:
        raise UsageError("--eval-iters must be >= 0")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise UsageError(
            f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}: "
            "launch a multiple of TP x PP processes (torchrun --nproc-per-node ...) or change "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size"
        )
    dp = world_size // (tp * pp)
    args.world_size, args.data_parallel_size = world_size, dp
    if args.num_layers % pp:
        raise UsageError(f"--num-layers {args.num_layers} is not divisible by PP {pp}")
    if args.num_attention_heads % tp:
        raise UsageError(f"--num-attention-heads {args.num_attention_heads} is not divisible by TP {tp}")
    if args.hidden_size % args.num_attention_heads:
        raise UsageError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}"
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
        print(f"{PROG}: note: {args.num_microbatches} microbatches for PP {pp} leave pipeline bubbles",
              file=sys.stderr)
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
        arms = hdet.arms or dp
        if dp % arms:
            raise UsageError(
                f"--hdet-arms {arms} must divide the data-parallel size {dp} "
                f"(world {world_size} / TP {tp} / PP {pp}); use one of "
                f"{[a for a in range(1, dp + 1) if dp % a == 0]}"
            )
        args.hdet_num_arms = arms
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
            "runs", datetime.datetime.now().strftime("gpt-%Y%m%d-%H%M%S"))
    return hdet


def _checkpoint_iteration(load_dir: str, ckpt_step: Optional[int] = None) -> Optional[int]:
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
# Megatron pieces (imported after the process group exists)
# ==============================================================================================


def _in_process_results_queue() -> None:
    """CPU only: megatron's torch_dist writer makes its result queue with a *spawned*
    ``multiprocessing.Manager`` (a fresh interpreter that imports torch: ~10 s per rank on a busy
    2-core machine, at the first save). A synchronous save writes from this process's threads,
    so an in-process queue does the same job."""
    try:
        import queue

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if getattr(filesystem_async, "_results_queue", "missing") is None:
            filesystem_async._results_queue = queue.Queue()
    except Exception:  # an upstream change: keep megatron's default
        pass


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Trainer:
    """Everything one rank holds: model chunks, optimizer, scheduler, HDET, data, metrics."""

    def __init__(self, args, hdet_config) -> None:
        import torch
        import torch.distributed as dist

        from hdet_megatron.megatron import cpu as _cpu  # noqa: F401 (CPU shims first)
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.args, self.hdet_config = args, hdet_config
        self.torch, self.dist, self.ps = torch, dist, ps
        self.rank = dist.get_rank()
        self.cuda = torch.cuda.is_available() and args.distributed_backend != "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.t0 = time.perf_counter() - (time.time() - _PROCESS_START)  # wall clock from launch

        arms = args.hdet_num_arms
        instances = arms if (hdet_config is not None and args.use_distributed_optimizer) else 1
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            num_distributed_optimizer_instances=instances,
        )
        self.instances = instances
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = ps.get_data_parallel_world_size()
        self.is_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

        self._build_data()
        self._build_model()
        self._build_optimizer()
        self.arm = self.hdet.layout.arm if self.hdet else 0
        self.num_arms = self.hdet.layout.num_arms if self.hdet else 1
        self.iteration = 0
        self.consumed_train_samples = 0
        self.resumed_from = None
        if args.load:
            self.load()

    # -- data ------------------------------------------------------------------------------------
    def _build_data(self) -> None:
        from hdet_megatron.megatron import data as D

        args = self.args
        if args.mock_data:
            self.tokenizer = D.ByteLevelTokenizer()
            vocab = args.vocab_size or self.tokenizer.vocab_size
            self.data_meta = {"description": f"MockGPTDataset (vocab {vocab})"}
        else:
            self.tokenizer = D.build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                                               args.tokenizer_model)
            vocab = self.tokenizer.vocab_size
            prefixes, _ = D.parse_data_path(args.data_path)
            report = D.check_dataset_fits(prefixes, args.split, args.seq_length,
                                          need_valid=args.eval_iters > 0)
            # The test split is optional: evaluated at the end only if it fills a sample.
            self.test_fits = all(c[2]["tokens"] > args.seq_length for c in report)
            metas = [D.read_sidecar(p) or {"prefix": p} for p in prefixes]
            self.data_meta = {
                "description": "; ".join(m.get("description") or os.path.basename(m["prefix"]) for m in metas),
                "documents": sum(m.get("documents", 0) for m in metas),
                "tokens": sum(m.get("tokens", 0) for m in metas),
            }
        self.vocab_size = vocab
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        self.padded_vocab_size = int(math.ceil(vocab / multiple) * multiple)
        gbs = args.global_batch_size
        sizes = [args.train_iters * gbs, max(args.eval_iters, 1) * gbs, max(args.eval_iters, 1) * gbs]
        cache = args.data_cache_path
        if cache is None and not args.mock_data:
            cache = os.path.join(os.path.dirname(os.path.abspath(_data_prefixes(args.data_path)[0])), "cache")
        self.train_ds, self.valid_ds, self.test_ds = D.build_gpt_datasets(
            data_path=args.data_path, mock=args.mock_data, split=args.split,
            seq_length=args.seq_length, seed=args.seed, sizes=sizes, tokenizer=self.tokenizer,
            cache_path=cache,
        )
        if self.train_ds is None:
            raise D.DataError("the train split is empty; check --split")
        if not getattr(self, "test_fits", True) and self.test_ds is not None:
            self.log(f"test split of --split {args.split} holds less than one sequence; no test evaluation")
            self.test_ds = None

    def _iterator(self, dataset, consumed: int, dp_rank: Optional[int] = None):
        """Micro-batches of ``dataset`` from sample ``consumed`` on, in Megatron's order; the
        slice of DP rank ``dp_rank`` (default: this rank's)."""
        from hdet_megatron.megatron import data as D

        rank = self.dp_rank if dp_rank is None else dp_rank
        sampler = D.PretrainingSampler(len(dataset), consumed, self.args.micro_batch_size, rank, self.dp)
        return D.batch_iterator(dataset, sampler, self.device if self.cuda else None)

    @contextlib.contextmanager
    def _evaluating(self):
        """Model chunks in eval mode (dropout off) without autograd, restored afterwards."""
        for chunk in self.model:
            chunk.eval()
        try:
            with self.torch.no_grad():
                yield
        finally:
            for chunk in self.model:
                chunk.train()

    # -- model and optimizer --------------------------------------------------------------------
    def _build_model(self) -> None:
        import torch.nn.functional as F

        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        args, torch, ps = self.args, self.torch, self.ps
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        config = TransformerConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=args.num_attention_heads,
            use_cpu_initialization=not self.cuda,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            pipeline_dtype=dtype,
            bf16=args.bf16,
            params_dtype=dtype,
            hidden_dropout=args.hidden_dropout,
            attention_dropout=args.attention_dropout,
            init_method_std=args.init_method_std,
            gated_linear_unit=args.swiglu,
            activation_func=F.silu if args.swiglu else F.gelu,
            add_bias_linear=not args.disable_bias_linear,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            bias_activation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
        if args.transformer_impl == "transformer_engine":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            spec = get_gpt_layer_with_transformer_engine_spec()
        else:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            spec = get_gpt_layer_local_spec()
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
        )
        if self.cuda:
            model.cuda(torch.cuda.current_device())
        if args.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer,
            num_distributed_optimizer_instances=self.instances,
        )
        ddp = DistributedDataParallel(config, ddp_config, model)
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.config = config
        self.model = [ddp]
        local = sum(p.numel() for p in model.parameters())
        count = torch.tensor([float(local)], device=self.device)
        self.dist.all_reduce(count, group=ps.get_model_parallel_group())
        self.num_params = int(count.item())

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        args, torch = self.args, self.torch
        opt_config = OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        gbs = args.global_batch_size
        kwargs = dict(
            init_lr=args.lr_warmup_init,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * gbs,
            lr_decay_steps=args.lr_decay_iters * gbs,
            lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters * gbs,
            wd_incr_style="constant",
            wsd_decay_steps=(args.lr_wsd_decay_iters * gbs) if args.lr_wsd_decay_iters else None,
            lr_wsd_decay_style=args.lr_wsd_decay_style,
            use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
            override_opt_param_scheduler=args.override_opt_param_scheduler,
        )
        self.hdet = None
        if self.hdet_config is None:
            self.scheduler = OptimizerParamScheduler(self.optimizer, **kwargs)
            return
        from hdet_megatron.megatron.runtime import HDET
        from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

        self.scheduler = HDETOptimizerParamScheduler(self.optimizer, hdet=self.hdet_config, **kwargs)
        probe = self.probe_losses if self.hdet_config.signal == "probe" else None
        self.hdet = HDET(self.hdet_config, self.model, self.optimizer, self.scheduler, probe_fn=probe)

    # -- one iteration ---------------------------------------------------------------------------
    @staticmethod
    def _loss_func(loss_mask, output_tensor):
        import torch

        losses = output_tensor.float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * mask) / mask.sum().clamp(min=1)
        # clone: the schedule divides the returned loss in place by the number of microbatches.
        return loss, {"lm loss": loss.detach().clone()}

    def _forward_step(self, data_iterator, model):
        from functools import partial

        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
        return output, partial(self._loss_func, batch["loss_mask"])

    def _forward_backward(self, data_iterator, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=self.args.num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    def _mean_loss(self, losses):
        if not losses:
            return None
        return self.torch.stack([o["lm loss"].float() for o in losses]).mean()

    def train_step(self, data_iterator):
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._forward_backward(data_iterator, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.args.global_batch_size)
        # Counted before hdet.step so that a window-end probe starts at the next unseen sample.
        self.consumed_train_samples += self.args.global_batch_size
        window = self.hdet.step(losses) if self.hdet is not None else None
        return self._mean_loss(losses), window

    def probe_losses(self) -> list:
        """HDET's probe (``--hdet-signal probe``), called by ``HDET`` at every converge: a
        forward-only pass of this arm's model on the next global batch's first data-parallel
        shard. It is the same batch on every rank (sampler with DP rank 0 of ``self.dp``), and
        no arm has trained on it yet, so arms differ only by what their hyperparameters did
        in the window. Collective (a pipeline forward); dropout off, as in evaluation."""
        start = self.consumed_train_samples
        if start + self.args.global_batch_size > len(self.train_ds):
            start = 0  # the run's last window: every sample has been seen, any shared batch will do
        shared = self._iterator(self.train_ds, start, dp_rank=0)  # the same batch on every rank
        with self._evaluating():
            return self._forward_backward(shared, forward_only=True)

    # -- learning rates for the logs ---------------------------------------------------------------
    def lr_view(self) -> dict:
        """Base LR, centre (base x scale) and every arm's LR now (the same on every rank)."""
        sched = self.scheduler
        groups = self.optimizer.param_groups
        base = sched.get_lr(groups[0]) if groups else 0.0
        window = sched.window if self.hdet is not None else None
        if self.hdet is None or self.hdet_config.axis("lr") is None:
            return {"base_lr": base, "lr": base, "arm_lrs": [base] * self.num_arms, "scale": 1.0,
                    "window": window}
        scale = sched.controller.scale("lr")
        arm_lrs = [base * sched.arm_factor("lr", a) for a in range(self.num_arms)]
        return {"base_lr": base, "lr": base * scale, "arm_lrs": arm_lrs, "scale": scale, "window": window}

    def reduce_per_arm(self, values: list) -> tuple[list[float], list[list[float]]]:
        """All-reduce per-step loss tensors (reporter ranks) into per-arm means. Collective.

        Returns ``(mean over replicas per entry, per-entry list of per-arm means)``."""
        torch, A = self.torch, self.num_arms
        buf = torch.zeros(len(values), 2 * A, dtype=torch.float64, device=self.device)
        if self.is_reporter and values:
            buf[:, self.arm] = torch.stack([v.to(torch.float64) for v in values])
            buf[:, A + self.arm] = 1.0
        self.dist.all_reduce(buf)
        rows = buf.cpu().tolist()
        means, per_arm = [], []
        for row in rows:
            sums, counts = row[:A], row[A:]
            means.append(sum(sums) / max(sum(counts), 1.0))
            per_arm.append([s / c if c else float("nan") for s, c in zip(sums, counts)])
        return means, per_arm

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, dataset, kind: str) -> Optional[dict]:
        args, torch = self.args, self.torch
        if dataset is None or args.eval_iters == 0:
            return None
        start = time.perf_counter()
        data = self._iterator(dataset, 0)  # the same batches every evaluation
        values = []
        with self._evaluating():
            for _ in range(args.eval_iters):
                loss = self._mean_loss(self._forward_backward(data, forward_only=True))
                if loss is not None:
                    values.append(loss)
        mean_vals = torch.stack(values).mean().reshape(1) if values else torch.zeros(1, device=self.device)
        means, per_arm = self.reduce_per_arm([mean_vals[0]] if self.is_reporter else [torch.zeros((), device=self.device)])
        loss = means[0]
        converged = self.hdet is None or self.hdet.steps_in_window == 0
        return {
            "type": kind, "iteration": self.iteration, "loss": loss,
            "ppl": math.exp(min(loss, 50.0)), "arm_losses": per_arm[0],
            "converged": converged, "seconds": time.perf_counter() - start,
        }

    # -- checkpoints: hdet_megatron.megatron.checkpointing (torch_dist, HDET state in the common
    #    state, converge-on-save, resume rules, distributed optimizer) -------------------------
    def _topology(self) -> dict:
        return {"tp": self.args.tensor_model_parallel_size, "pp": self.args.pipeline_model_parallel_size,
                "dp": self.dp, "arms": self.num_arms}

    def save(self) -> dict:
        """Converge (HDET ``converge_on_save``), then write ``SAVE/iter_XXXXXXX``. Collective."""
        from hdet_megatron.megatron import checkpointing

        start = time.perf_counter()
        if not self.cuda:
            _in_process_results_queue()
        window = checkpointing.save_checkpoint(
            self.args.save, self.iteration, self.model,
            None if self.args.no_save_optim else self.optimizer, self.scheduler, self.hdet,
            format=self.args.ckpt_format,
        )
        path = checkpointing.checkpoint_dir(self.args.save, self.iteration)
        return {"type": "checkpoint", "iteration": self.iteration, "path": os.path.abspath(path),
                "seconds": time.perf_counter() - start, "window": window}

    def load(self) -> None:
        from hdet_megatron.megatron import checkpointing

        args = self.args
        if _checkpoint_iteration(args.load, args.ckpt_step) is None:
            self.log(f"no checkpoint in {args.load}; training from scratch")
            return
        iteration = checkpointing.load_checkpoint(
            args.load, self.model, self.optimizer, self.scheduler, self.hdet,
            iteration=args.ckpt_step, load_optimizer=not args.no_load_optim,
            load_rng=not args.no_load_rng,
            override_hdet_config=True if args.override_opt_param_scheduler else None,
        )
        self.iteration = int(iteration)
        # Megatron's pretraining sampler position (constant global batch size).
        self.consumed_train_samples = self.iteration * args.global_batch_size
        self.resumed_from = self.iteration
        self.log(f"resumed from {checkpointing.checkpoint_dir(args.load, iteration)} at iteration {self.iteration}")

    # -- output ----------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[pretrain_gpt] {message}", flush=True)


# ==============================================================================================
# The training loop
# ==============================================================================================


def train(args, hdet_config) -> int:
    import torch

    from hdet_megatron.metrics import MetricsWriter

    tr = Trainer(args, hdet_config)
    rank0 = tr.rank == 0
    writer = None
    if rank0:
        writer = MetricsWriter(args.run_dir, False if args.no_tensorboard else args.tensorboard_dir)
    write = writer.write if writer else (lambda record: None)
    say = tr.log

    gbs, seq = args.global_batch_size, args.seq_length
    tokens_per_iter = gbs * seq
    topo = tr._topology()
    say(
        f"GPT {tr.num_params / 1e6:.2f}M params ({args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_attention_heads} heads, seq {seq}, vocab {tr.vocab_size}->{tr.padded_vocab_size}) | "
        f"world {args.world_size} = TP{topo['tp']} x PP{topo['pp']} x DP{topo['dp']} | "
        f"global batch {gbs} ({args.num_microbatches} microbatches of {args.micro_batch_size}/rank) | "
        f"{'device ' + str(tr.device)}"
    )
    say(f"data: {tr.data_meta['description']} | "
        f"{'split ' + args.split if not args.mock_data else 'mock splits'}: train {len(tr.train_ds)} samples, "
        f"valid {len(tr.valid_ds) if tr.valid_ds is not None else 0}, "
        f"test {len(tr.test_ds) if tr.test_ds is not None else 0}")
    if tr.hdet is not None:
        c = hdet_config
        axes = ", ".join(f"{a.name}:{a.spread:.3g}" for a in c.axes)
        say(f"HDET on: {tr.num_arms} arms over DP{tr.dp}, period {c.period}, axes {axes}, "
            f"grad_sync {c.grad_sync}, auto {c.auto} (sigma {c.temperature}, lambda {c.meta_lr})")
    else:
        say("HDET off (--no-hdet): plain Megatron data-parallel training")
    say(f"run dir {os.path.abspath(args.run_dir)}"
        + (f" | TensorBoard {writer.tensorboard_dir}" if writer and writer.tensorboard_dir else ""))
    write({
        "type": "run", "iteration": tr.iteration, "args": {k: v for k, v in vars(args).items()
                                                           if isinstance(v, (int, float, str, bool, list, type(None)))},
        **topo, "world": args.world_size, "hdet": hdet_config.fingerprint() if hdet_config else None,
        "num_params": tr.num_params, "tokens_per_iter": tokens_per_iter, "resumed_from": tr.resumed_from,
        "data": tr.data_meta, "vocab_size": tr.vocab_size, "padded_vocab_size": tr.padded_vocab_size,
        "device": str(tr.device),
    })

    train_iter = tr._iterator(tr.train_ds, tr.consumed_train_samples)
    start_iteration = tr.iteration
    loop_start = time.perf_counter()
    last_log_time, last_log_iter = loop_start, tr.iteration
    pending: list[tuple[int, Any, dict]] = []  # (iteration, loss tensor, lr view)
    last_lrs = tr.lr_view()
    last_loss = float("nan")

    def flush() -> None:
        nonlocal last_log_time, last_log_iter, last_loss, paused
        if not pending:
            return
        zero = torch.zeros((), device=tr.device)
        means, per_arm = tr.reduce_per_arm([loss if loss is not None else zero for _, loss, _ in pending])
        now = time.perf_counter()
        steps = pending[-1][0] - last_log_iter
        tok_s = tokens_per_iter * steps / max(now - last_log_time, 1e-9)
        for (it, _, lrs), mean, arms in zip(pending, means, per_arm):
            write({"type": "step", "iteration": it, "loss": mean,
                   "arm_losses": arms if tr.hdet is not None else None,
                   "tokens_per_s": tok_s, "elapsed_s": now - loop_start,
                   "consumed_samples": it * gbs, **lrs})
        last_loss = means[-1]
        it = pending[-1][0]
        if not args.quiet:
            done = it - start_iteration
            eta = (now - loop_start - paused) / max(done, 1) * (args.train_iters - it)
            lrs = pending[-1][2]
            spread = ""
            if tr.hdet is not None and len(lrs["arm_lrs"]) > 1:
                spread = f" x{lrs['scale']:.3f} (arms {min(lrs['arm_lrs']):.2e}..{max(lrs['arm_lrs']):.2e})"
            say(f"iter {it:5d}/{args.train_iters} | loss {means[-1]:.4f} | lr {lrs['base_lr']:.3e}{spread} | "
                f"{tok_s:,.0f} tok/s | {_fmt_time(now - tr.t0)} elapsed | ETA {_fmt_time(eta)}")
        pending.clear()
        last_log_time, last_log_iter = now, it

    signal_name = "probe" if hdet_config is not None and hdet_config.signal == "probe" else "loss"

    def on_window(m, lrs) -> None:
        if m is None:
            return
        record = {"type": "window", "iteration": tr.iteration,
                  "window": m.window, "steps": m.steps, "arm_losses": m.arm_losses,
                  "signal": hdet_config.signal, "arm_train_losses": m.arm_train_losses,
                  "arm_values": m.arm_values, "arm_lrs": lrs["arm_lrs"], "base_lr": lrs["base_lr"],
                  "scales": m.scales, "update": m.update, "excluded": m.excluded,
                  "converge_seconds": m.converge_seconds, "converge_bytes": m.converge_bytes,
                  "forced": m.forced}
        write(record)
        if not args.quiet:
            arms = " | ".join(
                f"arm{a} lr {lr:.2e} {signal_name} {loss:.4f}" for a, (lr, loss) in enumerate(zip(lrs["arm_lrs"], m.arm_losses)))
            before = lrs["scale"]
            after = m.scales.get("lr", before)
            say(f"converge w{m.window} @ iter {tr.iteration}{' (forced)' if m.forced else ''}: {arms} | "
                f"lr scale {before:.4f} -> {after:.4f} | {m.converge_seconds * 1e3:.1f} ms, "
                f"{m.converge_bytes / 1e6:.2f} MB")

    paused = 0.0  # seconds spent in evaluation and checkpointing (not in tokens/s and ETA)

    def pause_from(start: float) -> None:
        nonlocal paused, last_log_time
        spent = time.perf_counter() - start
        paused += spent
        last_log_time += spent

    def do_eval(kind: str = "valid", dataset=None) -> Optional[dict]:
        t = time.perf_counter()
        result = tr.evaluate(tr.valid_ds if dataset is None else dataset, kind)
        pause_from(t)
        if result is not None:
            write(result)
            what = "averaged model" if result["converged"] and tr.hdet is not None else (
                "each arm's model" if tr.hdet is not None else "model")
            arms = ""
            if tr.hdet is not None and not result["converged"]:
                arms = " | arms " + ", ".join(f"{x:.4f}" for x in result["arm_losses"])
            say(f"{kind} @ iter {tr.iteration}: loss {result['loss']:.4f} | ppl {result['ppl']:.2f} "
                f"({what}){arms} | {result['seconds']:.1f} s")
        return result

    def do_save() -> None:
        flush()
        t = time.perf_counter()
        rec = tr.save()
        pause_from(t)
        on_window(rec.pop("window"), last_lrs)
        write(rec)
        say(f"saved checkpoint {rec['path']} ({rec['seconds']:.1f} s)")

    valid = None
    while tr.iteration < args.train_iters:
        lrs = tr.lr_view()  # the LRs this iteration's update uses
        loss, window = tr.train_step(train_iter)
        tr.iteration += 1
        pending.append((tr.iteration, loss, lrs))
        last_lrs = lrs
        if window is not None or tr.iteration % args.log_interval == 0 or tr.iteration == args.train_iters:
            flush()
        on_window(window, lrs)
        # Save before evaluating: the save converges (HDET), so validation then sees the
        # averaged model.
        if args.save and args.save_interval and tr.iteration % args.save_interval == 0 \
                and tr.iteration < args.train_iters:
            do_save()
        if args.eval_iters and tr.iteration % args.eval_interval == 0 and tr.iteration < args.train_iters:
            valid = do_eval()

    flush()
    train_seconds = time.perf_counter() - loop_start - paused
    # End of training: the final model is the averaged one.
    if tr.hdet is not None:
        on_window(tr.hdet.converge(), last_lrs)
    valid = do_eval() or valid
    if args.save and tr.iteration > (tr.resumed_from or 0):
        do_save()
    test = do_eval("test", tr.test_ds) if tr.test_ds is not None else None
    wall = time.perf_counter() - tr.t0
    steps_run = tr.iteration - start_iteration
    final = {"type": "final", "iteration": tr.iteration, "train_loss": last_loss,
             "valid_loss": valid["loss"] if valid else None, "test_loss": test["loss"] if test else None,
             "train_seconds": train_seconds, "wall_seconds": wall, "steps": steps_run,
             "tokens_per_s": tokens_per_iter * steps_run / max(train_seconds, 1e-9),
             "scales": dict(tr.scheduler.controller.scales()) if tr.hdet is not None else None}
    write(final)
    say(f"done: {steps_run} iterations in {_fmt_time(train_seconds)} ({final['tokens_per_s']:,.0f} tok/s), "
        f"final train loss {last_loss:.4f}"
        + (f", validation loss {valid['loss']:.4f}" if valid else "")
        + (f", test loss {test['loss']:.4f}" if test else "")
        + (f", lr scale {tr.scheduler.controller.scale('lr'):.4f}" if tr.hdet is not None and hdet_config.axis('lr') else "")
        + f" | wall {_fmt_time(wall)}")
    if tr.hdet is not None:
        tr.hdet.close()
    if writer:
        writer.close()
    tr.ps.destroy_model_parallel()
    return 0


def _init_distributed(args) -> None:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    args.distributed_backend = backend
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]) == os.environ["WORLD_SIZE"]:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single node: loopback is enough
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))


def main(argv: Optional[list[str]] = None) -> int:
    rank = int(os.environ.get("RANK", "0"))

    def fail(message: str) -> int:
        if rank == 0:
            print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return 2

    try:
        args, hdet_config = parse_args(argv)
    except UsageError as exc:
        return fail(str(exc))
    _init_distributed(args)
    import torch.distributed as dist

    from hdet_megatron.megatron import cpu as _cpu  # noqa: F401
    from hdet_megatron.megatron.checkpointing import HDETCheckpointError
    from hdet_megatron.megatron.data import DataError
    from hdet_megatron.megatron.layout import HDETSetupError

    try:
        return train(args, hdet_config)
    except (DataError, HDETSetupError, HDETConfigError, HDETCheckpointError, UsageError) as exc:
        return fail(str(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
