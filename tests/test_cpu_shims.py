"""Each CPU shim is still needed, still matches upstream, and is installed once."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from hdet_megatron.megatron import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are off with CUDA")


@pytest.fixture(scope="module", autouse=True)
def shims():
    assert cpu.apply_cpu_shims() is True
    return cpu


def test_apply_is_idempotent():
    before = {r.qualname: _installed(r) for r in cpu.SOURCE_REWRITES}
    assert cpu.apply_cpu_shims() is True
    assert {r.qualname: _installed(r) for r in cpu.SOURCE_REWRITES} == before


def _installed(rewrite):
    import importlib

    owner = importlib.import_module(rewrite.module)
    for part in rewrite.qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    return (
        owner.__dict__[rewrite.qualname.split(".")[-1]]
        if isinstance(owner, type)
        else getattr(owner, rewrite.qualname.split(".")[-1])
    )


def test_shim_a_megatron_core_does_not_import_without_stub():
    """Without the paged_stash stub, ``import megatron.core`` fails on a triton-less machine."""
    proc = subprocess.run(
        [sys.executable, "-c", "import megatron.core.models.gpt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "triton" in proc.stderr
    # ...and the stub stands in only for that one module, not for triton itself.
    assert "triton" not in sys.modules or sys.modules["triton"] is not None
    assert cpu._PAGED_STASH_OPS in sys.modules


def test_shim_b_upstream_rng_needs_cuda():
    original = cpu.original_function("tensor_parallel.random._get_cuda_rng_state")
    with pytest.raises((AssertionError, RuntimeError)):
        original()
    original_add = cpu.original_function("tensor_parallel.random.CudaRNGStatesTracker.add")
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    with pytest.raises((AssertionError, RuntimeError)):
        original_add(tracker, "x", 123)


def test_shim_b_tracker_forks_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 42)
    outside = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)  # caller's stream untouched
    torch.manual_seed(42)
    assert torch.equal(inside, torch.rand(4))


@pytest.mark.parametrize("rewrite", cpu.SOURCE_REWRITES, ids=lambda r: r.qualname)
def test_shim_cd_upstream_still_has_cuda_spelling(rewrite):
    """Every rewritten function still contains each CUDA spelling it replaces (else: revisit)."""
    source, _original = cpu.rewritten_source(rewrite)  # raises ShimError when a pattern is gone
    assert rewrite.replacements, "a rewrite must replace something"
    for old, _new in rewrite.replacements:
        assert "cuda" in old
        assert old not in source


def test_shim_cd_upstream_calls_fail_on_cpu():
    """Calling two upstream originals directly fails without CUDA; the shimmed ones work."""
    from megatron.core import utils as mutils
    from megatron.core.transformer import utils as tutils

    original_mask = cpu.original_function("megatron.core.transformer.utils.get_default_causal_mask")
    with pytest.raises((AssertionError, RuntimeError)):
        original_mask(5)
    assert tutils.get_default_causal_mask(3).tolist() == [
        [False, True, True],
        [False, False, True],
        [False, False, False],
    ]
    original_l2 = cpu.original_function("megatron.core.utils.local_multi_tensor_l2_norm")
    tensors = [torch.ones(3), torch.ones(1)]
    with pytest.raises((AssertionError, RuntimeError)):
        original_l2(1024, None, [tensors], False)
    norm, _ = mutils.local_multi_tensor_l2_norm(1024, None, [tensors], False)
    assert float(norm) == 2.0


def test_stale_pattern_fails_loudly():
    bad = cpu.SourceRewrite(
        "megatron.core.transformer.utils", "get_default_causal_mask", (("torch.cuda.nope()", "x"),)
    )
    with pytest.raises(cpu.ShimError, match="no longer contains"):
        cpu.rewritten_source(bad)


def test_moe_shims_move_token_splits_to_numpy_and_keep_the_router_on_cpu():
    """MoE on CPU: the alltoall dispatcher's token splits become host numpy arrays (what
    ``all_to_all_single`` takes; upstream converts only CUDA tensors), and the router's gate
    stays on the CPU (upstream moves it to the current CUDA device)."""
    import numpy as np

    from megatron.core.transformer.moe import moe_utils

    original = cpu.original_function("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu")
    splits = torch.tensor([3, 5])
    assert original(splits, as_numpy=True) is splits  # unconverted: all_to_all_single refuses it
    moved = moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(moved, np.ndarray) and moved.tolist() == [3, 5]
    assert moe_utils.maybe_move_tensor_to_cpu(splits) is splits
    gating = cpu.original_function("megatron.core.transformer.moe.router.Router.gating")
    assert "torch.cuda.current_device()" in inspect.getsource(gating)


def test_shim_e_sequence_parallel_with_the_local_layer_norm():
    """Upstream's WrappedTorchNorm refuses sequence parallelism; the shim builds the same norm
    and marks its params ``sequence_parallel`` (as Apex's FusedLayerNorm does), so that
    finalize_model_grads sums their gradients over TP. The config is left as it was."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    original = cpu.original_function("transformer.torch_norm.WrappedTorchNorm.__new__")
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        original(WrappedTorchNorm, config, 8)
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm) and config.sequence_parallel is True
    assert [getattr(p, "sequence_parallel", False) for p in norm.parameters()] == [True, True]
    config.sequence_parallel = False
    plain = WrappedTorchNorm(config, 8)
    assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())
