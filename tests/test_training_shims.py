"""The megatron.training CPU shims (``apply_training_cpu_shims``): each is still needed, still
matches upstream, and works. The end-to-end proof that the set is sufficient is
``tests/test_training_patch.py::test_patched_loop_end_to_end_*``."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from hdet_megatron.megatron import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are off with CUDA")


@pytest.fixture(scope="module", autouse=True)
def shims():
    assert cpu.apply_training_cpu_shims() is True
    assert cpu.shims_applied() and cpu.training_shims_applied()
    return cpu


@pytest.fixture(scope="module")
def world_of_one():
    """A 1-rank gloo group in this process (for the shimmed reductions)."""
    if dist.is_initialized():
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _original(module: str, qualname: str):
    return cpu.original_function(f"{module}.{qualname}")


def test_apply_is_idempotent():
    import megatron.training.initialize as init

    before = init.initialize_megatron
    assert cpu.apply_training_cpu_shims() is True
    assert init.initialize_megatron is before


def test_this_machine_has_no_cuda():
    """Why shims G-L are needed: every CUDA spelling they replace fails here."""
    assert not torch.cuda.is_available()  # G: initialize_megatron asserts it
    assert torch.cuda.device_count() == 0  # H, I: model-parallel init and RNG seeding skipped
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # J, K, L: literal CUDA tensors
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.Stream()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.get_rng_state()


@pytest.mark.parametrize("rewrite", cpu.TRAINING_SOURCE_REWRITES, ids=lambda r: r.qualname)
def test_upstream_still_has_the_spelling(rewrite):
    """Every rewritten function still contains each spelling it replaces (else: revisit)."""
    source, _original_func = cpu.rewritten_source(rewrite)  # raises ShimError when gone
    assert rewrite.replacements
    for old, _new in rewrite.replacements:
        assert old not in source


def test_shim_e_typing_override_missing_before_312():
    """megatron/training/models/gpt.py imports ``typing.override`` (Python 3.12+)."""
    import megatron.training.models.gpt as gpt

    assert "from typing import" in inspect.getsource(gpt) and "override" in inspect.getsource(gpt)
    fresh = subprocess.run(
        [sys.executable, "-c", "import typing; print(hasattr(typing, 'override'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh.stdout.strip() == str(sys.version_info >= (3, 12))
    import typing

    assert hasattr(typing, "override")  # installed by the shim where it was missing


def test_shim_f_device_arch_version():
    original = _original("megatron.training.utils.common_utils", "get_device_arch_version")
    with pytest.raises((AssertionError, RuntimeError)):
        original()
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    assert common_utils.get_device_arch_version() == 0
    # arguments.py imported it by name: the alias is the shimmed function too.
    assert arguments.get_device_arch_version is common_utils.get_device_arch_version


def test_shim_j_jit_warmup_uses_cuda_tensors():
    from megatron.training import initialize

    assert 'device="cuda"' in inspect.getsource(initialize._warmup_jit_function)


def test_shim_k_timers():
    from megatron.core.timers import Timer

    timer = Timer("x")
    with pytest.raises((AssertionError, RuntimeError)):
        _original("megatron.core.timers", "Timer.start")(timer)
    timer = Timer("y")
    timer.start()
    timer.stop()
    assert timer.elapsed() >= 0.0


def test_shim_k_model_parallel_reductions(world_of_one):
    if world_of_one is None:
        pytest.skip("torch.distributed already initialized in this process")
    from megatron.training.utils import common_utils

    module = "megatron.training.utils.common_utils"
    with pytest.raises((AssertionError, RuntimeError)):
        _original(module, "reduce_max_stat_across_model_parallel_group")(1.5, world_of_one)
    with pytest.raises((AssertionError, RuntimeError)):
        _original(module, "logical_and_across_model_parallel_group")(True, world_of_one)
    assert common_utils.reduce_max_stat_across_model_parallel_group(1.5, world_of_one) == 1.5
    assert common_utils.reduce_max_stat_across_model_parallel_group(None, world_of_one) is None
    assert common_utils.logical_and_across_model_parallel_group(True, world_of_one) is True


def test_shim_k_checkpoint_tracker_all_reduce(world_of_one, tmp_path):
    if world_of_one is None:
        pytest.skip("torch.distributed already initialized in this process")
    from megatron.training import checkpointing

    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("5")
    with pytest.raises((AssertionError, RuntimeError)):
        _original("megatron.training.checkpointing", "read_metadata")(str(tracker))
    assert checkpointing.read_metadata(str(tracker)) == (5, False)


def test_wheel_has_no_makefile_for_compile_helpers():
    """Not a CPU shim (GPU machines too): ``initialize_megatron`` runs ``make`` in
    megatron/core/datasets, which the wheel ships without a Makefile; the patched ``pretrain``
    calls ``training_hooks.use_prebuilt_dataset_helpers()``, which uses the built extension."""
    from hdet_megatron.megatron import training_hooks

    from megatron.core.datasets import utils as dataset_utils

    directory = os.path.dirname(dataset_utils.__file__)
    assert not os.path.exists(os.path.join(directory, "Makefile"))
    if shutil.which("make"):
        upstream = subprocess.run(["make", "-C", directory], capture_output=True, text=True, timeout=60)
        assert upstream.returncode != 0
    assert training_hooks.use_prebuilt_dataset_helpers() is True
    assert dataset_utils.compile_helpers() is None
    assert training_hooks.use_prebuilt_dataset_helpers() is True  # idempotent
    from megatron.core.datasets import helpers_cpp  # noqa: F401
