"""pretrain_gpt.py's Trainer: what one rank holds (model, optimizer, scheduler, HDET) and one step,
probe, evaluation, checkpoint."""

from __future__ import annotations

import contextlib
import math
import os
import random
import time

#: Wall clock of the launch (``pretrain_gpt.py`` imports this module first).
PROCESS_START = time.time()

from gpt_args import UsageError, _checkpoint_iteration, resolve_device  # noqa: E402
from gpt_data import TrainerData  # noqa: E402


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


class Trainer(TrainerData):
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
        self.cuda = resolve_device(args) == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.t0 = time.perf_counter() - (time.time() - PROCESS_START)  # wall clock from launch

        arms = args.hdet_num_arms
        instances = arms if (hdet_config is not None and args.use_distributed_optimizer) else 1
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
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

        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
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
            context_parallel_size=args.context_parallel_size,
            sequence_parallel=args.sequence_parallel,
            **self._moe_config(),
        )
        # MoE: SequentialMLP experts (the grouped GEMM needs Transformer Engine's kernels).
        moe = dict(num_experts=args.num_experts, moe_grouped_gemm=False)
        if args.transformer_impl == "transformer_engine":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            spec = get_gpt_layer_with_transformer_engine_spec(**moe)
        else:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            spec = get_gpt_layer_local_spec(**moe)
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

    def _moe_config(self) -> dict:
        args = self.args
        if args.num_experts is None:
            return {}
        return dict(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        )

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
        from hdet_megatron.probe import BatchProbe

        self.scheduler = HDETOptimizerParamScheduler(self.optimizer, hdet=self.hdet_config, **kwargs)
        # Always a probe (HDET runs it only when auto-LR reads it): the next global batch, which
        # no arm has trained on yet, scored by a forward-only pass.
        probe = BatchProbe(self._probe_loss, self._probe_batch)
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
        if self.args.context_parallel_size > 1:
            # Megatron-LM's split for Transformer Engine's CP attention: this rank's two
            # load-balanced sequence chunks (2 x CP chunks, rank i holds i and 2 CP - 1 - i).
            from megatron.core.utils import get_batch_on_this_cp_rank

            batch = get_batch_on_this_cp_rank(
                {**batch, "cu_seqlens": None},
                is_hybrid_cp=False,
                cp_group=self.ps.get_context_parallel_group(),
            )
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

    def _probe_batch(self, window: int) -> list:
        """The probe's batch of a window (HDET fetches it once, at the window's end): the
        microbatches of the next global batch, which no arm has trained on yet. ``probe``: its
        first data-parallel shard, the same batch on every rank (sampler with DP rank 0), so arms
        differ only by what their hyperparameters did in the window. ``line``/``average``: this
        replica's own shard (HDET scores it at every point of the update line and averages over
        all replicas)."""
        start = self.consumed_train_samples
        if start + self.args.global_batch_size > len(self.train_ds):
            start = 0  # the run's last window: every sample has been seen, any batch will do
        dp_rank = 0 if self.hdet_config.signal == "probe" else None
        microbatches = self._iterator(self.train_ds, start, dp_rank=dp_rank)
        return [next(microbatches) for _ in range(self.args.num_microbatches)]

    def _probe_loss(self, batch: list) -> list:
        """HDET's probe score: a forward-only pass of this rank's model on ``batch`` (HDET runs it
        in eval mode without autograd). Collective (a pipeline forward)."""
        return self._forward_backward(iter(batch), forward_only=True)

    # -- learning rates for the logs ---------------------------------------------------------------
    def lr_view(self) -> dict:
        """Base LR, centre (base x scale) and every arm's LR now (the same on every rank)."""
        sched = self.scheduler
        groups = self.optimizer.param_groups
        base = sched.get_lr(groups[0]) if groups else 0.0
        window = sched.window if self.hdet is not None else None
        if self.hdet is None or self.hdet_config.axis("lr") is None:
            return {
                "base_lr": base,
                "lr": base,
                "arm_lrs": [base] * self.num_arms,
                "scale": 1.0,
                "window": window,
            }
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
            per_arm.append([s / c if c else float("nan") for s, c in zip(sums, counts, strict=True)])
        return means, per_arm

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, dataset, kind: str) -> dict | None:
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
        means, per_arm = self.reduce_per_arm(
            [mean_vals[0]] if self.is_reporter else [torch.zeros((), device=self.device)]
        )
        loss = means[0]
        converged = self.hdet is None or self.hdet.steps_in_window == 0
        return {
            "type": kind,
            "iteration": self.iteration,
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)),
            "arm_losses": per_arm[0],
            "converged": converged,
            "seconds": time.perf_counter() - start,
        }

    # -- checkpoints: hdet_megatron.megatron.checkpointing (torch_dist, HDET state in the common
    #    state, converge-on-save, resume rules, distributed optimizer) -------------------------
    def _topology(self) -> dict:
        return {
            "tp": self.args.tensor_model_parallel_size,
            "pp": self.args.pipeline_model_parallel_size,
            "dp": self.dp,
            "arms": self.num_arms,
        }

    def save(self) -> dict:
        """Converge (HDET ``converge_on_save``), then write ``SAVE/iter_XXXXXXX``. Collective."""
        from hdet_megatron.megatron import checkpointing

        start = time.perf_counter()
        if not self.cuda:
            _in_process_results_queue()
        window = checkpointing.save_checkpoint(
            self.args.save,
            self.iteration,
            self.model,
            None if self.args.no_save_optim else self.optimizer,
            self.scheduler,
            self.hdet,
            format=self.args.ckpt_format,
        )
        path = checkpointing.checkpoint_dir(self.args.save, self.iteration)
        return {
            "type": "checkpoint",
            "iteration": self.iteration,
            "path": os.path.abspath(path),
            "seconds": time.perf_counter() - start,
            "window": window,
        }

    def load(self) -> None:
        from hdet_megatron.megatron import checkpointing

        args = self.args
        if _checkpoint_iteration(args.load, args.ckpt_step) is None:
            self.log(f"no checkpoint in {args.load}; training from scratch")
            return
        try:
            iteration = checkpointing.load_checkpoint(
                args.load,
                self.model,
                self.optimizer,
                self.scheduler,
                self.hdet,
                iteration=args.ckpt_step,
                load_optimizer=not args.no_load_optim,
                load_rng=not args.no_load_rng,
                override_hdet_config=True if args.override_opt_param_scheduler else None,
            )
        except ValueError as exc:
            # Megatron-Core matches saved optimizer param groups by (wd_mult, lr_mult, max_lr,
            # min_lr, ...) (MegatronOptimizer._filter_and_reorder_param_groups), so a resume with
            # another --lr / --min-lr cannot find them, --override-opt-param-scheduler or not.
            if "Could not find parameter group" not in str(exc):
                raise
            raise UsageError(
                f"--load {args.load}: the checkpoint's optimizer param groups were saved with "
                "another --lr / --min-lr (Megatron-Core matches groups by max_lr and min_lr): "
                "resume with the saved --lr and --min-lr, or add --no-load-optim to start the "
                "optimizer state afresh"
            ) from None
        self.iteration = int(iteration)
        # Megatron's pretraining sampler position (constant global batch size).
        self.consumed_train_samples = self.iteration * args.global_batch_size
        self.resumed_from = self.iteration
        self.log(
            f"resumed from {checkpointing.checkpoint_dir(args.load, iteration)} at iteration {self.iteration}"
        )

    # -- output ----------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[pretrain_gpt] {message}", flush=True)


# ==============================================================================================
# The training loop
# ==============================================================================================
