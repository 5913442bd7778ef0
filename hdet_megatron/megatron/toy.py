"""A tiny, real Megatron-Core GPT training setup (used by the tests, benchmarks and the demo).

Nothing here is mocked: ``parallel_state``, ``GPTModel`` with the local layer spec, Megatron
``DistributedDataParallel``, ``get_megatron_optimizer`` and the pipeline schedules from
``get_forward_backward_func``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hdet_megatron.megatron.cpu import apply_cpu_shims

apply_cpu_shims()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402


@dataclass
class ToyGPTSetup:
    """Sizes and switches of a tiny GPT training run."""

    tp: int = 1
    """Tensor-model-parallel size."""
    pp: int = 1
    """Pipeline-model-parallel size."""
    num_layers: int = 2
    """Transformer layers (must be divisible by ``pp``)."""
    hidden_size: int = 64
    """Hidden size."""
    num_attention_heads: int = 4
    """Attention heads (divisible by ``tp``)."""
    vocab_size: int = 128
    """Vocabulary size (divisible by ``tp``)."""
    seq_length: int = 32
    """Tokens per sample."""
    micro_batch_size: int = 2
    """Samples per microbatch."""
    num_microbatches: int = 2
    """Microbatches per iteration (gradient accumulation)."""
    lr: float = 1e-3
    """Learning rate of the optimizer (and the scheduler's max_lr)."""
    seed: int = 1234
    """Model-parallel seed (weights are identical across DP ranks)."""
    bf16: bool = False
    """bf16 params with fp32 main params (Megatron's Float16Module + mixed precision optimizer)."""
    fp16: bool = False
    """fp16 params with fp32 main params and Megatron's dynamic loss scaler."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1)."""
    num_distributed_optimizer_instances: int = 1
    """Partial distributed optimizer: number of full optimizer copies across DP."""
    overlap_grad_reduce: bool = False
    """Overlap DP gradient reduction with backward."""
    hidden_dropout: float = 0.0
    """Hidden dropout probability."""
    attention_dropout: float = 0.0
    """Attention dropout probability."""
    extra_parallel_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for ``initialize_model_parallel``."""
    cuda: bool = False
    """Model and batches on the current CUDA device (Megatron's GPU initialization, so weights
    differ from the CPU run's but agree across DP replicas). Needs CUDA; CPU shims then off."""
    transformer_impl: str = "local"
    """Layer spec: ``local`` (Megatron-Core modules) or ``transformer_engine`` (needs TE + CUDA)."""
    num_experts: int | None = None
    """MoE: experts per MoE layer (every layer's MLP; the local spec's ``SequentialMLP``);
    None for a dense GPT."""
    moe_router_topk: int = 2
    """MoE: experts each token is routed to."""
    moe_token_dispatcher_type: str = "alltoall"
    """MoE: ``alltoall`` or ``allgather`` token dispatcher."""
    ep: int = 1
    """Expert-model-parallel size (experts split across consecutive data-parallel ranks)."""
    etp: int | None = None
    """Expert-tensor-parallel size (None: Megatron's default, the TP size)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs TP > 1; MoE with TP x EP requires it)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule; model chunks per rank), None: off."""
    cp: int = 1
    """Context-parallel size. Megatron's local attention refuses CP > 1 (real CP attention is
    Transformer Engine's): give ``core_attention`` too, and split each sequence across the CP
    ranks the way that attention expects."""
    core_attention: Any = None
    """Replacement for the layer spec's core attention module class (None: the spec's own)."""


def init_parallel(setup: ToyGPTSetup) -> None:
    """Initialize Megatron's model-parallel groups on the already-initialized default group."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=setup.tp,
        pipeline_model_parallel_size=setup.pp,
        context_parallel_size=setup.cp,
        virtual_pipeline_model_parallel_size=setup.vpp,
        num_distributed_optimizer_instances=setup.num_distributed_optimizer_instances,
        expert_model_parallel_size=setup.ep,
        expert_tensor_parallel_size=setup.etp,
        **setup.extra_parallel_kwargs,
    )
    # Same CPU seed on every rank: weights are initialized on the CPU generator, identically on
    # every DP replica, and a rebuilt model in the same process is the same model.
    torch.manual_seed(setup.seed)
    model_parallel_cuda_manual_seed(setup.seed)


def destroy_parallel() -> None:
    """Tear down Megatron's model-parallel groups (the default group stays)."""
    parallel_state.destroy_model_parallel()


def _dtype(setup: ToyGPTSetup) -> torch.dtype:
    return torch.bfloat16 if setup.bf16 else torch.float16 if setup.fp16 else torch.float32


def transformer_config(setup: ToyGPTSetup) -> TransformerConfig:
    """Megatron's TransformerConfig for the toy model of ``setup``."""
    return TransformerConfig(
        num_layers=setup.num_layers,
        hidden_size=setup.hidden_size,
        num_attention_heads=setup.num_attention_heads,
        # On CUDA: Megatron's GPU path (weights drawn on the device from the model-parallel RNG
        # tracker, seeded identically on every DP replica).
        use_cpu_initialization=not setup.cuda,
        tensor_model_parallel_size=setup.tp,
        pipeline_model_parallel_size=setup.pp,
        context_parallel_size=setup.cp,
        virtual_pipeline_model_parallel_size=setup.vpp,
        pipeline_dtype=_dtype(setup),
        bf16=setup.bf16,
        fp16=setup.fp16,
        params_dtype=_dtype(setup),
        hidden_dropout=setup.hidden_dropout,
        attention_dropout=setup.attention_dropout,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        sequence_parallel=setup.sequence_parallel,
        **_moe_config(setup),
    )


def _moe_config(setup: ToyGPTSetup) -> dict:
    if setup.num_experts is None:
        return {}
    return dict(
        num_moe_experts=setup.num_experts,
        moe_router_topk=setup.moe_router_topk,
        moe_token_dispatcher_type=setup.moe_token_dispatcher_type,
        expert_model_parallel_size=setup.ep,
        expert_tensor_parallel_size=setup.etp,
        # No auxiliary load-balancing loss: the loss the arms compare is the LM loss alone.
        moe_aux_loss_coeff=0.0,
    )


def layer_spec(setup: ToyGPTSetup):
    """The GPT layer spec of ``setup.transformer_impl``."""
    if setup.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    if setup.transformer_impl != "local":
        raise ValueError(f"transformer_impl={setup.transformer_impl!r}: use 'local' or 'transformer_engine'")
    # SequentialMLP experts (moe_grouped_gemm=False): the grouped GEMM needs Transformer Engine.
    spec = get_gpt_layer_local_spec(num_experts=setup.num_experts, moe_grouped_gemm=False)
    if setup.core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = setup.core_attention
    return spec


def build_model(setup: ToyGPTSetup, ddp_group_kwargs: dict | None = None) -> list:
    """GPTModel chunk(s) on this rank, wrapped in Megatron DDP. Returns the list of chunks
    (``setup.vpp`` of them with a virtual pipeline, else one)."""
    config = transformer_config(setup)
    if setup.vpp is None:
        return [_build_chunk(setup, config, None, ddp_group_kwargs)]
    # Megatron-LM's get_model: one chunk per virtual stage; buckets only in the first chunk.
    return [
        _build_chunk(setup, config, vp, ddp_group_kwargs, disable_bucketing=vp > 0) for vp in range(setup.vpp)
    ]


def _build_chunk(setup, config, vp_stage, ddp_group_kwargs, disable_bucketing: bool = False):
    virtual = dict(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(setup),
        vocab_size=setup.vocab_size,
        max_sequence_length=setup.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(**virtual),
        post_process=parallel_state.is_pipeline_last_stage(**virtual),
        **({"vp_stage": vp_stage} if vp_stage is not None else {}),
    )
    if setup.cuda:
        model.cuda(torch.cuda.current_device())
    if setup.bf16 or setup.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=setup.overlap_grad_reduce,
        use_distributed_optimizer=setup.use_distributed_optimizer,
        num_distributed_optimizer_instances=setup.num_distributed_optimizer_instances,
    )
    ddp = DistributedDataParallel(
        config, ddp_config, model, disable_bucketing=disable_bucketing, **(ddp_group_kwargs or {})
    )
    if vp_stage is None:
        config.no_sync_func = ddp.no_sync
    elif vp_stage == 0:
        config.no_sync_func = []
    if vp_stage is not None:
        config.no_sync_func.append(ddp.no_sync)
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def build_optimizer(setup: ToyGPTSetup, model: list, config_overrides=None, **overrides: Any):
    """Megatron's optimizer (Adam) over ``model``; ``overrides`` replace OptimizerConfig fields."""
    kwargs = dict(
        optimizer="adam",
        lr=setup.lr,
        min_lr=setup.lr / 10,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=setup.bf16,
        fp16=setup.fp16,
        params_dtype=_dtype(setup),
        use_distributed_optimizer=setup.use_distributed_optimizer,
    )
    kwargs.update(overrides)
    return get_megatron_optimizer(OptimizerConfig(**kwargs), model, config_overrides=config_overrides)


def synthetic_batches(setup: ToyGPTSetup, seed: int, period: int = 7) -> Iterator[dict]:
    """Endless learnable batches: token sequences that repeat with a short period.

    ``seed`` picks the stream; ranks of one DP replica must pass the same seed (they consume
    the same data), different DP replicas different seeds.
    """
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, setup.vocab_size, (setup.micro_batch_size, 1), generator=gen)
        steps = torch.arange(setup.seq_length + 1).unsqueeze(0) % period
        tokens = (starts + steps * 3) % setup.vocab_size
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(setup.seq_length).unsqueeze(0).expand(setup.micro_batch_size, -1),
            "loss_mask": torch.ones(setup.micro_batch_size, setup.seq_length),
        }


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    # clone: the schedule divides the returned loss in place by the number of microbatches.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Megatron-style forward step: ``(output_tensor, loss_func)``."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def train_step(setup: ToyGPTSetup, model: list, optimizer, data_iterator) -> tuple[list, bool]:
    """One iteration: zero grads, forward/backward over microbatches, optimizer step.

    Returns the per-microbatch loss dicts (empty on non-last pipeline stages) and whether the
    optimizer step succeeded.
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward(setup, model, data_iterator, forward_only=False)
    update_successful, _grad_norm, _zeros = optimizer.step()
    return losses, update_successful


def forward_backward(setup: ToyGPTSetup, model: list, data_iterator, forward_only: bool) -> list:
    """Megatron's pipeline schedule over ``setup.num_microbatches`` microbatches; returns the
    per-microbatch loss dicts (empty on non-last pipeline stages)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=setup.num_microbatches,
        seq_length=setup.seq_length,
        micro_batch_size=setup.micro_batch_size,
        forward_only=forward_only,
    )


def data_iterator_for_rank(setup: ToyGPTSetup, base_seed: int = 0):
    """Batches for this rank: one stream per DP replica, shared by its TP/PP ranks."""
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = synthetic_batches(setup, seed=base_seed * 1000 + dp_rank)
    if not setup.cuda:
        return batches
    device = torch.device("cuda", torch.cuda.current_device())
    return ({k: v.to(device, non_blocking=True) for k, v in b.items()} for b in batches)


@contextlib.contextmanager
def parallel(setup: ToyGPTSetup):
    """Model-parallel groups of ``setup`` for the ``with`` block, destroyed afterwards."""
    init_parallel(setup)
    try:
        yield
    finally:
        destroy_parallel()


def scheduler_kwargs(setup: ToyGPTSetup, train_iters: int, warmup: int = 2) -> dict:
    """Arguments of Megatron's ``OptimizerParamScheduler`` for a short cosine schedule."""
    return dict(
        init_lr=0.0,
        max_lr=setup.lr,
        min_lr=setup.lr / 10,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(train_iters, warmup + 1),
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=max(train_iters, 1),
        wd_incr_style="constant",
    )
