"""Shims that let megatron-core 0.19.2 run on a machine without CUDA (gloo backend).

Everything CPU-specific lives here and is applied by one call, :func:`apply_cpu_shims`, before
(or after) ``import megatron.core``. It is idempotent and a no-op where CUDA is available.

Design: no global interception (a ``TorchFunctionMode`` that rewrites ``device="cuda"`` costs
about 25% per step). Instead each shim targets one *named* megatron function:

* A. ``megatron.core.transformer.moe.ops.paged_stash`` imports triton unconditionally; a stub
  module stands in for it (only that module; ``triton`` itself is left absent because many
  megatron modules ``try: import triton``).
* B. the model-parallel RNG tracker reads/writes the CUDA generator; it is routed to the CPU
  generator (``tensor_parallel.random._get_cuda_rng_state``, ``_set_cuda_rng_state``,
  ``CudaRNGStatesTracker.add``).
* C/D. functions on megatron's hot paths that call ``torch.cuda.current_device()``,
  ``torch.cuda.synchronize()``, streams, or create ``device="cuda"`` tensors, or check
  ``param.type() == "torch.cuda.FloatTensor"``: their source is recompiled with those exact
  spellings replaced by CPU equivalents (:data:`SOURCE_REWRITES`). The recompiled function has
  no run-time cost over the original. Each rewrite asserts that every pattern it replaces is
  still in the upstream source, so an upstream change fails loudly instead of silently.

* E. sequence parallelism with the local spec's LayerNorm (Apex is absent): see
  :func:`_install_sequence_parallel_norm`.

``tests/test_cpu_shims.py`` proves each shim is still needed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MEGATRON_CORE_VERSION = "0.19.2"

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


class ShimError(RuntimeError):
    """An upstream function no longer looks like the code a shim was written for."""


@dataclass(frozen=True)
class SourceRewrite:
    """Recompile one megatron function with literal CUDA spellings replaced."""

    module: str
    """Dotted module name, e.g. ``megatron.core.optimizer.clip_grads``."""
    qualname: str
    """``func`` or ``Class.method`` inside :attr:`module`."""
    replacements: tuple[tuple[str, str], ...]
    """``(old, new)`` source substrings; every ``old`` must occur in the upstream source."""


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: on CPU every op is already ordered."""

    def wait_stream(self, other) -> None:  # noqa: D401 - mirrors torch API
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *_args, **_kwargs) -> _CpuStream:
        # An event recorded on a CPU "stream" is already complete; ``synchronize`` is a no-op.
        return self


_CPU_STREAM = _CpuStream()


def _cpu_stream(*_args, **_kwargs) -> _CpuStream:
    # One object: code that compares streams (``current_stream() != side_stream``) sees that on
    # CPU there is only one.
    return _CPU_STREAM


def _nullcontext(*_args, **_kwargs):
    return contextlib.nullcontext()


# Names the rewritten sources may reference; injected into the rewritten function's globals.
_SHIM_GLOBALS = {
    "_hdet_cpu_stream": _cpu_stream,
    "_hdet_nullcontext": _nullcontext,
}

_CUDA_DEVICE = (
    ("device='cuda'", "device='cpu'"),
    ('device="cuda"', 'device="cpu"'),
)
_CURRENT_DEVICE = (("torch.cuda.current_device()", "'cpu'"),)
_SYNC = (("torch.cuda.synchronize()", "None"),)
_TYPE_CHECKS = (
    ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
    ("'torch.cuda.HalfTensor'", "'torch.HalfTensor'"),
    ("'torch.cuda.BFloat16Tensor'", "'torch.BFloat16Tensor'"),
)

SOURCE_REWRITES: tuple[SourceRewrite, ...] = (
    # Tied input/output embeddings with PP > 1: the last stage's copy is moved to the GPU before
    # the first/last-stage all-reduce (Megatron-LM ties them by default).
    SourceRewrite(
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
        (("weight.data = weight.data.cuda()", "weight.data = weight.data"),),
    ),
    # Megatron's cross-DP weight-hash check gathers the hashes on the GPU.
    SourceRewrite(
        "megatron.core.utils",
        "check_param_hashes_across_dp_replicas",
        (("torch.stack(local_param_hashes).cuda()", "torch.stack(local_param_hashes)"),),
    ),
    # Causal mask of the unfused softmax (local attention path).
    SourceRewrite("megatron.core.transformer.utils", "get_default_causal_mask", _CUDA_DEVICE[1:]),
    SourceRewrite("megatron.core.utils", "local_multi_tensor_l2_norm", _CUDA_DEVICE[1:]),
    # fp16 loss scalers keep their scale in a CUDA tensor.
    SourceRewrite("megatron.core.optimizer.grad_scaler", "MegatronGradScaler.__init__", _CUDA_DEVICE[:1]),
    SourceRewrite("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.__init__", _CUDA_DEVICE[:1]),
    # Global memory buffer used by TP sequence-parallel gathers and others.
    SourceRewrite("megatron.core.utils", "GlobalMemoryBuffer.get_tensor", _CURRENT_DEVICE),
    # DDP grad buffers and the grad-sync streams.
    SourceRewrite(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBuffer.__init__",
        _CURRENT_DEVICE + (('device="cuda"', 'device="cpu"'),),
    ),
    SourceRewrite(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup.start_grad_sync",
        (
            ("torch.cuda.current_stream()", "_hdet_cpu_stream()"),
            ("torch.cuda.stream(", "_hdet_nullcontext("),
        ),
    ),
    SourceRewrite(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup.finish_grad_sync",
        (("torch.cuda.current_stream()", "_hdet_cpu_stream()"),),
    ),
    SourceRewrite(
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel.__init__",
        (("torch.cuda.Stream(device=torch.cuda.current_device())", "_hdet_cpu_stream()"),),
    ),
    # Pipeline schedules count tokens in a CUDA tensor.
    SourceRewrite(
        "megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", _CUDA_DEVICE[1:]
    ),
    SourceRewrite(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_with_interleaving",
        _CUDA_DEVICE[1:],
    ),
    SourceRewrite(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
        _CUDA_DEVICE[1:],
    ),
    # Pipeline p2p buffers.
    SourceRewrite(
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2PCommunicator._communicate_shapes",
        _CURRENT_DEVICE + _SYNC,
    ),
    SourceRewrite(
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2PCommunicator._communicate",
        _CURRENT_DEVICE + _SYNC,
    ),
    # Gradient clipping / norms.
    SourceRewrite("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", _CUDA_DEVICE[:1]),
    SourceRewrite(
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        _CUDA_DEVICE[:1] + _TYPE_CHECKS[:1],
    ),
    SourceRewrite("megatron.core.optimizer.clip_grads", "count_zeros_fp32", _CUDA_DEVICE[:1]),
    # Optimizers.
    SourceRewrite(
        "megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group", _CUDA_DEVICE[:1]
    ),
    SourceRewrite("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__", _CUDA_DEVICE[:1]),
    SourceRewrite(
        "megatron.core.optimizer.optimizer",
        "Float16OptimizerWithFloat16Params.__init__",
        _TYPE_CHECKS,
    ),
    SourceRewrite("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__", _CUDA_DEVICE[:1]),
    SourceRewrite("megatron.core.optimizer.optimizer", "ChainedOptimizer.get_loss_scale", _CURRENT_DEVICE),
    SourceRewrite(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups",
        _TYPE_CHECKS,
    ),
    SourceRewrite(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.__init__",
        _TYPE_CHECKS[1:],
    ),
    SourceRewrite(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.load_state_dict",
        _CURRENT_DEVICE,
    ),
    # --use-torch-fsdp2: TorchFullyShardedDataParallel builds its DeviceMesh with a literal
    # "cuda" device type (fully_shard then calls torch.cuda.current_device()).
    SourceRewrite(
        "megatron.core.distributed.torch_fully_sharded_data_parallel",
        "TorchFullyShardedDataParallel.__init__",
        (
            (
                'DeviceMesh.from_group(self.process_group, "cuda")',
                'DeviceMesh.from_group(self.process_group, "cpu")',
            ),
        ),
    ),
    # MoE alltoall dispatcher: a side stream for the device-to-host copies of the token
    # splits (on CPU they are already host tensors and every op is ordered).
    SourceRewrite(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher.__init__",
        (("torch.cuda.Stream()", "_hdet_cpu_stream()"),),
    ),
    SourceRewrite(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        (
            ("torch.cuda.current_stream()", "_hdet_cpu_stream()"),
            ("torch.cuda.stream(", "_hdet_nullcontext("),
        ),
    ),
    # Tensor-parallel communication buffers (sequence parallel, MoE token dispatch).
    SourceRewrite("megatron.core.tensor_parallel.mappings", "_gather_along_last_dim", _CURRENT_DEVICE),
    SourceRewrite("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", _CURRENT_DEVICE),
    SourceRewrite(
        "megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim", _CURRENT_DEVICE
    ),
    SourceRewrite("megatron.core.tensor_parallel.mappings", "_AllToAll.forward", _CURRENT_DEVICE),
    SourceRewrite(
        "megatron.core.tensor_parallel.layers",
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
        _CURRENT_DEVICE,
    ),
    # MoE alltoall dispatcher: the token splits are moved to the host (as numpy arrays, the form
    # ``all_to_all_single`` takes) only when they are CUDA tensors; on CPU convert them alike.
    SourceRewrite(
        "megatron.core.transformer.moe.moe_utils",
        "maybe_move_tensor_to_cpu",
        (("if torch.is_tensor(tensor) and tensor.is_cuda:", "if torch.is_tensor(tensor):"),),
    ),
    # MoE router: the gate weight is moved to the current CUDA device before every gating
    # matmul, and the router's token-count / expert-bias buffers are created there.
    SourceRewrite("megatron.core.transformer.moe.router", "Router.gating", _CURRENT_DEVICE),
    SourceRewrite("megatron.core.transformer.moe.router", "TopKRouter.__init__", _CURRENT_DEVICE),
    # dist_checkpointing (torch_dist) save: device-to-host staging ends with a CUDA sync.
    SourceRewrite(
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "FileSystemWriterAsync.preload_tensors",
        _SYNC,
    ),
    SourceRewrite(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "save_state_dict_async_finalize",
        _CURRENT_DEVICE,
    ),
)


@dataclass
class _ShimState:
    applied: bool = False
    training_applied: bool = False
    rewritten: dict[str, Callable] = field(default_factory=dict)
    """qualified name -> the original upstream function (kept so tests can compare)."""


_STATE = _ShimState()


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the shims stay off when it does)."""
    return torch.cuda.is_available()


def install_paged_stash_stub() -> None:
    """Shim A: stand in for the triton-only kernel module before ``import megatron.core``."""
    if _PAGED_STASH_OPS in sys.modules:
        return
    stub = types.ModuleType(_PAGED_STASH_OPS)
    stub.__doc__ = "hdet_megatron CPU stub: triton kernels are unavailable without CUDA."

    def _no_triton(*_args, **_kwargs):
        raise RuntimeError("MoE paged stash needs triton/CUDA; not available on this machine")

    # The module's namespace, filled through its dict (ModuleType declares no such attributes).
    stub.__dict__.update(
        GLOBAL_BLOCK_SIZE=1024,
        paged_stash_copy_kernel=_no_triton,
        paged_stash_pop_kernel=_no_triton,
        __all__=["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"],
    )
    sys.modules[_PAGED_STASH_OPS] = stub


def _resolve(module: types.ModuleType, qualname: str):
    owner = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return (
        owner,
        parts[-1],
        owner.__dict__[parts[-1]] if isinstance(owner, type) else getattr(owner, parts[-1]),
    )


def rewritten_source(rewrite: SourceRewrite) -> tuple[str, Callable]:
    """Upstream function and its source with the CUDA spellings replaced.

    Raises :class:`ShimError` if a pattern is gone: the shim is then stale and must be revisited.
    """
    module = importlib.import_module(rewrite.module)
    key = f"{rewrite.module}.{rewrite.qualname}"
    # Once shims are applied the live attribute is ours; read the upstream function instead.
    func = _STATE.rewritten.get(key) or _resolve(module, rewrite.qualname)[2]
    original = inspect.unwrap(func)
    source = textwrap.dedent(inspect.getsource(original))
    for old, new in rewrite.replacements:
        if old not in source:
            raise ShimError(
                f"{rewrite.module}.{rewrite.qualname} no longer contains {old!r}; "
                f"megatron-core changed (expected {MEGATRON_CORE_VERSION}): revisit "
                "hdet_megatron/megatron/cpu.py"
            )
        source = source.replace(old, new)
    return source, original


def _compile_rewrite(rewrite: SourceRewrite) -> tuple[Callable, Callable]:
    source, original = rewritten_source(rewrite)
    module = sys.modules[rewrite.module]
    owner, name, _ = _resolve(module, rewrite.qualname)
    # Compile inside a factory that defines ``__class__`` so zero-argument ``super()`` in
    # methods keeps working; globals are the upstream module's own.
    factory_src = "def _hdet_factory(__class__):\n" + textwrap.indent(source, "    ")
    factory_src += f"\n    return {name}\n"
    namespace: dict = {}
    globals_ = module.__dict__
    for key, value in _SHIM_GLOBALS.items():
        globals_.setdefault(key, value)
    code = compile(factory_src, f"<hdet cpu shim {rewrite.module}.{rewrite.qualname}>", "exec")
    exec(code, globals_, namespace)
    new_func = namespace["_hdet_factory"](owner if isinstance(owner, type) else None)
    previous = getattr(owner, name)
    setattr(owner, name, new_func)
    if not isinstance(owner, type):
        # ``from module import func`` elsewhere in megatron bound the old object: rebind those.
        # Aliases count too (``multi_tensor_l2norm = local_multi_tensor_l2_norm``).
        for mod_name, mod in list(sys.modules.items()):
            if not mod_name.startswith("megatron.") or mod is None:
                continue
            for attr, value in list(vars(mod).items()):
                if value is previous:
                    setattr(mod, attr, new_func)
    return original, new_func


class _SpuriousForkWarning(logging.Filter):
    """Drops CudaRNGStatesTracker.fork's CPU-RNG warning (see :func:`_install_rng_shims`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _install_rng_shims() -> None:
    """Shim B: the model-parallel RNG tracker keeps CPU generator states."""
    from megatron.core.tensor_parallel import random as mp_random

    def _get_cpu_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def _set_cpu_rng_state(new_state, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        # Mirrors CudaRNGStatesTracker.add (megatron/core/tensor_parallel/random.py) on the CPU
        # generator: record a state seeded with ``seed`` without disturbing the current one.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig_rng_state = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig_rng_state)

    _STATE.rewritten["tensor_parallel.random._get_cuda_rng_state"] = mp_random._get_cuda_rng_state
    _STATE.rewritten["tensor_parallel.random._set_cuda_rng_state"] = mp_random._set_cuda_rng_state
    _STATE.rewritten["tensor_parallel.random.CudaRNGStatesTracker.add"] = mp_random.CudaRNGStatesTracker.add
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    mp_random.CudaRNGStatesTracker.add = add
    # CudaRNGStatesTracker.fork warns when the CPU generator changed inside a fork: with this
    # shim the forked "CUDA" state *is* the CPU generator's (restored on exit), so every random op
    # in a fork (dropout in MoE experts, ...) would warn, on every rank and step.
    logging.getLogger(mp_random.__name__).addFilter(_SpuriousForkWarning())
    # torch.manual_seed also seeds CUDA lazily; model_parallel_cuda_manual_seed's
    # torch.cuda.manual_seed is a queued lazy call without CUDA and needs nothing.


def _install_sequence_parallel_norm() -> None:
    """Shim E: sequence parallelism with the local layer spec's LayerNorm.

    Without Apex (never installed on these machines) the local spec's ``LNImpl`` is
    ``torch_norm.WrappedTorchNorm``, which asserts ``not config.sequence_parallel``; TP x EP MoE
    layers require sequence parallelism. Apex's ``FusedLayerNorm`` does what this shim does: the
    norm itself is the plain one (each TP rank normalizes its own sequence shard, so it is the
    same computation), and its params are marked ``sequence_parallel`` so that
    ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums their
    gradients over the TP group, as it does for FusedLayerNorm."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__dict__["__new__"]
    _STATE.rewritten["transformer.torch_norm.WrappedTorchNorm.__new__"] = original

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False  # only to pass upstream's assert; restored below
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _install_source_rewrites() -> None:
    for rewrite in SOURCE_REWRITES:
        original, _ = _compile_rewrite(rewrite)
        _STATE.rewritten[f"{rewrite.module}.{rewrite.qualname}"] = original


def apply_cpu_shims(force: bool = False) -> bool:
    """Make megatron-core 0.19.2 usable without CUDA. Idempotent.

    Returns True when shims are (now) active, False when CUDA is present and nothing was done.
    ``force=True`` applies them even with CUDA (used by tests of the shims themselves).
    """
    if _STATE.applied:
        return True
    if cuda_available() and not force:
        return False
    install_paged_stash_stub()
    import megatron.core  # noqa: F401  (after the stub)
    from megatron.core import package_info

    # package_info appends a local "+<git sha>" when run inside a git checkout; compare releases.
    if package_info.__version__.split("+")[0] != MEGATRON_CORE_VERSION:
        raise ShimError(
            f"hdet_megatron's CPU shims target megatron-core=={MEGATRON_CORE_VERSION}, "
            f"found {package_info.__version__}; install the pinned version"
        )
    _install_rng_shims()
    _install_source_rewrites()
    _install_sequence_parallel_norm()
    _STATE.applied = True
    return True


def shims_applied() -> bool:
    """Whether the megatron.core CPU shims are applied in this process."""
    return _STATE.applied


def original_function(qualified_name: str) -> Callable:
    """The upstream function a shim replaced (for tests)."""
    return _STATE.rewritten[qualified_name]


# -- megatron.training (Megatron-LM's own loop) ---------------------------------------------------
# ``megatron/training/`` ships inside the megatron-core 0.19.2 wheel. On top of the megatron.core
# shims above its loop (``pretrain``) needs the following; each is proven necessary by
# ``tests/test_training_shims.py``:
#
# * E. ``typing.override`` (Python 3.12+) is imported by ``megatron/training/models/gpt.py`` and
#   ``hybrid.py``: on Python 3.11 it is aliased to ``typing_extensions.override``.
# * F-L. source rewrites (:data:`TRAINING_SOURCE_REWRITES`), same mechanism as C/D.

TRAINING_SOURCE_REWRITES: tuple[SourceRewrite, ...] = (
    # F. validate_args (TP > 1) and others read the GPU architecture.
    SourceRewrite(
        "megatron.training.utils.common_utils",
        "get_device_arch_version",
        (('torch.cuda.get_device_properties(torch.device("cuda:0")).major', "0"),),
    ),
    # G. pretrain() cannot pass allow_no_cuda=True.
    SourceRewrite(
        "megatron.training.initialize",
        "initialize_megatron",
        (('assert torch.cuda.is_available(), "Megatron requires CUDA."', "pass"),),
    ),
    # H. with torch.cuda.device_count() == 0 initialize_model_parallel is silently skipped (the
    # run then fails later: "pipeline_model parallel group is not initialized"). device_count
    # stays 0, so torch.cuda.set_device is never called.
    SourceRewrite(
        "megatron.training.initialize",
        "_initialize_distributed",
        (
            (
                "if device_count > 0 and not skip_model_parallel_init:",
                "if not skip_model_parallel_init:",
            ),
        ),
    ),
    # I. ...and the model-parallel RNG tracker would never be seeded (routed to the CPU generator
    # by shim B).
    SourceRewrite(
        "megatron.training.initialize",
        "_set_random_seed",
        (("if torch.cuda.device_count() > 0:", "if True:"),),
    ),
    # J. the JIT warm-up runs the fused kernels on CUDA tensors (they are switched off by the
    # CPU flags --no-bias-gelu-fusion --no-bias-dropout-fusion anyway).
    SourceRewrite(
        "megatron.training.initialize",
        "set_jit_fusion_options",
        (("_warmup_jit_function(tp_size=tp_size)", "None"),),
    ),
    # K. literal CUDA tensors/streams on the loop's path: start-time all-reduce, moving the model
    # to the GPU and the DDP-wrap stream, loss bookkeeping of the log line, the data-loader flags
    # broadcast, the loss-scale/grad-norm reductions, the checkpoint iteration all-reduce.
    SourceRewrite("megatron.training.training", "pretrain", _CUDA_DEVICE[:1]),
    SourceRewrite(
        "megatron.training.training",
        "get_model",
        (
            ("model_module.cuda(torch.cuda.current_device())", "None"),
            ("torch.cuda.Stream()", "_hdet_cpu_stream()"),
            ("torch.cuda.current_stream()", "_hdet_cpu_stream()"),
            ("torch.cuda.stream(", "_hdet_nullcontext("),
        ),
    ),
    SourceRewrite("megatron.training.training", "training_log", _CUDA_DEVICE[:1]),
    SourceRewrite(
        "megatron.training.training",
        "build_train_valid_test_data_loaders",
        _CUDA_DEVICE[:1],
    ),
    SourceRewrite(
        "megatron.training.utils.common_utils",
        "reduce_max_stat_across_model_parallel_group",
        _CURRENT_DEVICE,
    ),
    SourceRewrite(
        "megatron.training.utils.common_utils",
        "logical_and_across_model_parallel_group",
        _CURRENT_DEVICE,
    ),
    SourceRewrite("megatron.training.checkpointing", "read_metadata", _CUDA_DEVICE[:1]),
    # megatron.core timers, used by the loop only (torch.cuda.synchronize, a CUDA gather buffer).
    SourceRewrite("megatron.core.timers", "Timer.start", _SYNC),
    SourceRewrite("megatron.core.timers", "Timer.stop", _SYNC),
    SourceRewrite("megatron.core.timers", "Timers._get_elapsed_time_all_ranks", _CURRENT_DEVICE),
    # L. checkpoints save and restore the CUDA generator's state; the CPU generator's state
    # takes its place (the checkpoint keeps the same structure).
    SourceRewrite(
        "megatron.training.checkpointing",
        "get_rng_state",
        (("torch.cuda.get_rng_state()", "torch.get_rng_state()"),),
    ),
    SourceRewrite(
        "megatron.training.checkpointing",
        "load_checkpoint",
        (
            ("torch.cuda.set_rng_state(rng_state['cuda_rng_state'])", "None"),
            ("torch.cuda.set_rng_state(state_dict['cuda_rng_state'])", "None"),
        ),
    ),
)


def install_typing_override() -> bool:
    """Shim E: ``typing.override`` for Python < 3.12. Returns True when it was missing."""
    import typing

    if hasattr(typing, "override"):
        return False
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]  # 3.12+ in typeshed
    return True


def apply_training_cpu_shims(force: bool = False) -> bool:
    """Make ``megatron.training`` (the wheel's Megatron-LM loop) usable without CUDA. Idempotent.

    Applies :func:`apply_cpu_shims` first. Call it before ``import megatron.training``
    (``typing.override``); the rewrites import the ``megatron.training`` modules they patch.
    Returns False (and does nothing) when CUDA is available, unless ``force``.
    """
    if _STATE.training_applied:
        return True
    if cuda_available() and not force:
        return False
    apply_cpu_shims(force=force)
    install_typing_override()
    for rewrite in TRAINING_SOURCE_REWRITES:
        original, _ = _compile_rewrite(rewrite)
        _STATE.rewritten[f"{rewrite.module}.{rewrite.qualname}"] = original
    _STATE.training_applied = True
    return True


def training_shims_applied() -> bool:
    """Whether the megatron.training CPU shims are applied in this process."""
    return _STATE.training_applied
