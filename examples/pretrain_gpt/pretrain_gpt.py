r"""GPT pretraining on Megatron-Core with HDET (Hyperparameter-Divergent Ensemble Training).

Megatron-LM style flags; runs under ``torchrun`` (gloo on CPU, NCCL on GPUs), TP x PP x DP from
the flags, data from Megatron indexed datasets (``prepare_data.py``) through ``GPTDataset`` /
``BlendedMegatronDatasetBuilder``. ``--no-hdet`` trains plain Megatron.

    torchrun --standalone --nproc-per-node 4 examples/pretrain_gpt/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 8 \
        --train-iters 300 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
        --data-path .hdet-cache/data/stdlib-py311-XXXX_text_document --split 90,5,5 \
        --eval-interval 100 --eval-iters 10 --save runs/demo --hdet-period 25

Outputs in ``--run-dir`` (default: ``--save``, else ``runs/<timestamp>``): ``metrics.jsonl``
(per step, per window, validation; see ``hdet_megatron.metrics``), TensorBoard events when
``tensorboard`` is installed; ``hdet report RUN_DIR`` plots them. Checkpoints
(``hdet_megatron.megatron.checkpointing``): ``--save DIR`` -> ``DIR/iter_0000300/``
(``megatron.core.dist_checkpointing``, torch_dist; converged first) and
``DIR/latest_checkpointed_iteration.txt``; ``--load DIR`` resumes (model, optimizer, scheduler
incl. HDET controller state, data position, RNG).

This file is the entry point (process group, errors, exit code); the rest lives next to it, one
job per file: ``gpt_args.py`` (flags and their checks), ``gpt_data.py`` (tokenizer, datasets,
iterators), ``gpt_trainer.py`` (model, optimizer, HDET, one step, evaluation, checkpoints),
``gpt_loop.py`` (the training loop) and ``gpt_log.py`` (progress lines and metrics records).
"""

from __future__ import annotations

import datetime
import os
import sys

# The example's modules sit next to this file (also when it is loaded by path, not run).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gpt_args import (  # noqa: E402,F401  (re-exported for scripts and tests)
    DOCUMENT_SUFFIX,
    PROG,
    TRACKER,
    UsageError,
    build_parser,
    parse_args,
    resolve_device,
    validate_args,
)
from gpt_loop import train  # noqa: E402
from gpt_trainer import PROCESS_START as _PROCESS_START  # noqa: E402,F401  (first: the launch time)

from hdet_megatron.config import HDETConfigError  # noqa: E402


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
    device = resolve_device(args)
    backend = args.distributed_backend or ("nccl" if device == "cuda" else "gloo")
    args.device, args.distributed_backend = device, backend
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    elif torch.cuda.is_available():  # CPU training on a CUDA machine: megatron needs the CPU shims
        from hdet_megatron.megatron.cpu import apply_cpu_shims

        apply_cpu_shims(force=True)
    if (
        backend == "gloo"
        and os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]) == os.environ["WORLD_SIZE"]
    ):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single node: loopback is enough
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    if device == "cuda" and backend == "gloo":  # several ranks on one GPU: see gloo_cuda.py
        from hdet_megatron.megatron.gloo_cuda import apply_gloo_cuda_adapter

        apply_gloo_cuda_adapter()


#: How long a non-zero rank stays after an error it shares with rank 0 (see below).
RANK0_REPORT_WAIT_S = 30.0


def _let_rank0_report_first() -> None:
    """Under torchrun, keep a rank other than 0 alive for a bounded time after an error.

    torchrun stops every worker as soon as one exits non-zero. The errors here are found by
    every rank alike (the checks depend on the command line and the world size), and only rank
    0 prints them; a rank that got there first and left at once could have rank 0 killed before
    its one line is out (seen on a loaded machine: tests/test_pretrain_e2e.py). Rank 0's exit ends
    the wait early, since torchrun then terminates this rank; the bound only matters for an error
    that rank 0 did not share.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun: nobody kills peers
        return
    import time

    time.sleep(RANK0_REPORT_WAIT_S)


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))

    def fail(message: str) -> int:
        if rank == 0:
            print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        else:
            _let_rank0_report_first()
        return 2

    try:
        args, hdet_config = parse_args(argv)
    except UsageError as exc:
        return fail(str(exc))
    _init_distributed(args)
    import torch.distributed as dist

    from hdet_megatron.liveness import EXIT_NODE_LOST, start_liveness
    from hdet_megatron.megatron import cpu as _cpu  # noqa: F401
    from hdet_megatron.megatron.checkpointing import HDETCheckpointError
    from hdet_megatron.megatron.data import DataError
    from hdet_megatron.megatron.layout import HDETSetupError
    from hdet_megatron.window import show_notices

    show_notices("[pretrain_gpt]")  # HDET's startup notice as one of this script's progress lines
    liveness = start_liveness(args.node_timeout, prog=PROG)
    try:
        return train(args, hdet_config, liveness)
    except (DataError, HDETSetupError, HDETConfigError, HDETCheckpointError, UsageError) as exc:
        return fail(str(exc))
    except Exception as exc:
        # A collective failed: when another node is gone, say so in one line and stop this rank
        # now (tearing down a broken process group can hang).
        if liveness is not None and liveness.diagnose(exc):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_NODE_LOST)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    if code != 0:  # (an error: exit as usual, so that every rank's message gets out first)
        sys.exit(code)
    # Trained, everything written, the process group destroyed: leave without the interpreter's
    # finalization, where gloo's worker threads can abort the process (SIGABRT, "terminate
    # called without an active exception") while a peer node exits at the same moment
    # (seen in tests/test_multinode.py; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
