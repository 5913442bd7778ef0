"""Each CPU shim is still needed, still matches upstream, and is installed once."""

from __future__ import annotations

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
