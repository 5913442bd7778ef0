r"""GPT pretraining with HDET in Megatron-LM's own training loop (``megatron.training.pretrain``).

Megatron-LM style entry point (model provider, forward step, datasets provider, ``pretrain``) for
the ``megatron.training`` package of megatron-core 0.19.2 **after** ``patches/apply.sh`` has
patched it. Every Megatron-LM flag works as usual; the patch adds the ``--hdet-*`` flags
(``hdet_megatron/args.py``; ``--no-hdet`` trains plain Megatron). Per-arm LRs and every converge
are printed as ``[HDET] ...`` lines and written to TensorBoard / W&B when those are configured.
``--hdet-signal probe``/``line``/``average`` score the arms on the next training batches, read
ahead of the training stream and run through Megatron's ``forward_backward_func`` with
:func:`forward_step` (docs/patch-and-docker.md).

GPU (NGC image, see docker/README.md), 2 nodes x 8 GPUs, TP2, DP8 = 8 arms::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER:29500 \
        examples/pretrain_gpt/pretrain_gpt_hdet.py \
        --tensor-model-parallel-size 2 --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
        --micro-batch-size 4 --global-batch-size 256 --train-iters 100000 \
        --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --bf16 \
        --data-path $DATA --tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB --merge-file $MERGES \
        --save $CKPT --load $CKPT --save-interval 1000 --ckpt-format torch_dist \
        --hdet-period 1000 --hdet-spread 0.1111

CPU (gloo, 4 processes, TP2 x DP2; add the flags below, see tests/test_training_patch.py)::

    torchrun --nproc-per-node 4 examples/pretrain_gpt/pretrain_gpt_hdet.py \
        --distributed-backend gloo --transformer-impl local --attention-backend local \
        --spec local --no-persist-layer-norm --rerun-mode disabled --use-cpu-initialization \
        --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion \
        --no-bias-dropout-fusion --no-rope-fusion --tokenizer-type NullTokenizer --mock-data ...

Without CUDA the script applies ``hdet_megatron.megatron.cpu.apply_training_cpu_shims()`` before
any ``megatron`` import (no-op on GPU machines).
"""

from __future__ import annotations

import os
import sys
from functools import partial


def _prepare_cpu() -> bool:
    """CPU-only machines: shims before ``megatron`` is imported. Returns True when applied."""
    import torch

    if torch.cuda.is_available():
        return False
    from hdet_megatron.megatron.cpu import apply_training_cpu_shims

    apply_training_cpu_shims()
    # Megatron (arguments.py) insists on it with TP > 1 before Blackwell; irrelevant on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return True


ON_CPU = _prepare_cpu()

import torch  # noqa: E402

import megatron.training.training as _mtraining  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import (  # noqa: E402
    core_transformer_config_from_args,
    parse_and_validate_args,
)
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)

PATCH_HINT = (
    "megatron.training is not patched for HDET: run `bash patches/apply.sh` (megatron-core "
    "0.19.2), or `--python <venv>/bin/python` to pick the environment"
)


def require_patched() -> None:
    """Fail early and clearly when the ``megatron.training`` in use lacks the HDET patch."""
    if not hasattr(_mtraining, "_hdet_hooks"):
        raise SystemExit(PATCH_HINT)


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build this rank's GPTModel (local layer spec with ``--transformer-impl local``, else TE)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    if args.transformer_impl == "local":
        layer_spec = get_gpt_layer_local_spec(
            args.num_experts,
            args.moe_grouped_gemm,
            args.qk_layernorm,
            normalization=args.normalization,
        )
    else:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator, vp_stage=None):
    """The next micro-batch on first/last pipeline stages (every TP rank reads the same samples:
    the datasets are built on all TP ranks, so nothing is broadcast)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    device = _device()
    out = []
    for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"):
        value = batch.get(key)
        out.append(value.to(device, non_blocking=True) if value is not None else None)
    return tuple(out)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, token count, and the ``[loss_sum, num_tokens]`` report that Megatron
    reduces across DP for its log line (HDET reads it per rank, before that reduction)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model: GPTModel):
    """Forward one micro-batch; returns the output and the loss function to apply to it."""
    vp_stage = getattr(model, "vp_stage", None)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    return is_first_or_last_pipeline_stage(vp_stage)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train/valid/test GPT datasets (``--mock-data``: synthetic ``MockGPTDataset``)."""
    args = get_args()
    config = core_gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


# Every rank that needs data builds it (no TP broadcast in get_batch).
train_valid_test_datasets_provider.is_distributed = True


ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def main() -> None:
    require_patched()
    # Megatron-LM's and HDET's flag checks and the input files, on every rank before any work:
    # rank 0 prints one line, every rank exits 2 (launchers run the same check once before
    # torchrun: examples/pretrain_gpt/check_args.py).
    from check_args import check_megatron

    from hdet_megatron.preflight import InputError, fail

    try:
        check_megatron(sys.argv[1:], int(os.environ.get("WORLD_SIZE", "1")), args_defaults=ARGS_DEFAULTS)
    except InputError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            fail("pretrain_gpt_hdet.py", str(exc))
        sys.exit(2)
    args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
    pretrain(
        pretrain_cfg_container_from_args(args),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )


if __name__ == "__main__":
    main()
    sys.exit(0)
