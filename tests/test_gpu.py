"""The CUDA path: CPU shims stay off, every CUDA-only branch of hdet_megatron runs on a device.

Tests marked ``gpu`` need CUDA and are skipped elsewhere (``tests/conftest.py``); the others run
everywhere, on the ``device`` fixture's device (CUDA when there is one). On a GPU machine:
``pytest -m gpu`` or ``scripts/gpu_check.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or TE built against another torch/CUDA
        return False
    return True


# -- the CPU shims are no-ops where CUDA is present ------------------------------------------------


def test_apply_cpu_shims_does_nothing_when_cuda_is_present(monkeypatch):
    """With ``torch.cuda.is_available()`` True, neither shim entry point imports or rewrites
    anything (here CUDA is simulated: the shims' only CUDA check is that call)."""
    from hdet_megatron.megatron import cpu

    def live(rewrite):
        module = sys.modules.get(rewrite.module)
        return None if module is None else cpu._resolve(module, rewrite.qualname)[2]

    rewrites = cpu.SOURCE_REWRITES + cpu.TRAINING_SOURCE_REWRITES
    before_funcs = {r: live(r) for r in rewrites}
    before_modules = set(sys.modules)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fresh = cpu._ShimState()
    monkeypatch.setattr(cpu, "_STATE", fresh)  # as in a new process: nothing applied yet
    assert cpu.apply_cpu_shims() is False
    assert cpu.apply_training_cpu_shims() is False
    assert not cpu.shims_applied() and not cpu.training_shims_applied()
    assert fresh.rewritten == {}
    assert {r: live(r) for r in rewrites} == before_funcs
    assert set(sys.modules) == before_modules  # nothing imported (no stub, no megatron module)


_UNTOUCHED = textwrap.dedent(
    """
    import importlib, inspect, json, sys, typing
    import torch
    assert torch.cuda.is_available()
    import hdet_megatron.megatron  # applies the CPU shims: must be a no-op with CUDA
    from hdet_megatron.megatron import cpu
    import megatron.core.distributed, megatron.core.models.gpt, megatron.core.optimizer
    import megatron.core.pipeline_parallel, megatron.core.timers
    assert cpu.apply_cpu_shims() is False and cpu.apply_training_cpu_shims() is False
    assert not cpu.shims_applied() and cpu._STATE.rewritten == {}
    stub = sys.modules.get(cpu._PAGED_STASH_OPS)
    assert stub is None or "hdet_megatron CPU stub" not in (stub.__doc__ or ""), "paged_stash stubbed"
    from megatron.core.tensor_parallel import random as mp_random
    rng = [mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state,
           mp_random.CudaRNGStatesTracker.add]
    for f in rng:
        assert f.__code__.co_filename == mp_random.__file__, f
    checked, not_importable = [], {}
    for rw in cpu.SOURCE_REWRITES + cpu.TRAINING_SOURCE_REWRITES:
        try:
            module = importlib.import_module(rw.module)
        except Exception as exc:  # megatron.training needs packages the image may lack
            not_importable[rw.module] = repr(exc)[:200]
            continue
        func = inspect.unwrap(cpu._resolve(module, rw.qualname)[2])
        assert func.__code__.co_filename == module.__file__, (rw, func.__code__.co_filename)
        source = inspect.getsource(func)
        for old, _new in rw.replacements:
            assert old in source, (rw.qualname, old)
        assert "_hdet_cpu_stream" not in vars(module), rw.module
        checked.append(f"{rw.module}.{rw.qualname}")
    print(json.dumps({"checked": checked, "rng": len(rng), "not_importable": not_importable}))
    """
)


@pytest.mark.gpu
def test_cpu_shims_leave_megatron_untouched_on_cuda():
    """In a fresh interpreter on a CUDA machine every function a shim would replace is
    megatron's own (its file, its CUDA spellings), the RNG tracker is upstream and the triton
    module is not stubbed."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNTOUCHED], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every megatron.core rewrite is checked; megatron.training ones where importable.
    from hdet_megatron.megatron import cpu

    core = {f"{r.module}.{r.qualname}" for r in cpu.SOURCE_REWRITES}
    assert core <= set(report["checked"]), core - set(report["checked"])
    assert all(m.startswith("megatron.training") for m in report["not_importable"]), report


# -- CUDA-only branches of hdet_megatron --------------------------------------------------------------


def test_batch_iterator_moves_batches_to_the_device(device):
    """``data.batch_iterator(device=...)``: the ``non_blocking`` copy to the GPU (on CPU: the
    same call with the CPU device)."""
    from hdet_megatron.megatron import data as D

    samples = [
        {
            k: torch.full(
                (8,),
                float(i) if k == "loss_mask" else i,
                dtype=torch.float32 if k == "loss_mask" else torch.int64,
            )
            for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        for i in range(6)
    ]
    sampler = D.PretrainingSampler(len(samples), 0, micro_batch_size=2, dp_rank=1, dp_size=2)
    batches = list(D.batch_iterator(samples, sampler, device))
    assert len(batches) == 1 + (len(samples) - 4) // 4
    for batch in batches:
        assert {v.device for v in batch.values()} == {device}
    assert batches[0]["tokens"][:, 0].tolist() == [2, 3]  # DP rank 1's slice of the first batch
    assert batches[0]["loss_mask"].dtype == torch.float32


def test_rollback_store_round_trips_device_tensors(device):
    """``RollbackStore`` keeps device params in host memory and restores them on the device."""
    from hdet_megatron.megatron.runtime import RollbackStore

    tensors = [torch.randn(100, 3, device=device), torch.randn(7, device=device).bfloat16()]
    saved = [t.clone() for t in tensors]
    store = RollbackStore(tensors, directory=None)
    assert all(h.device.type == "cpu" for h in store._host)
    assert all(h.is_pinned() == (device.type == "cuda") for h in store._host)  # pinned on GPU
    for t in tensors:
        t.add_(1.0)
    store.restore()
    for t, s in zip(tensors, saved, strict=True):
        assert t.device == device
        assert torch.equal(t, s)


@pytest.mark.gpu
def test_rng_state_save_restore_includes_cuda_generator():
    """Checkpoints save and restore the CUDA generator (the ``torch.cuda.is_available()`` branch
    of the RNG state)."""
    from hdet_megatron.megatron import checkpointing as C

    torch.cuda.manual_seed(123)
    state = C._rng_state()
    assert "cuda" in state
    expected = torch.rand(5, device="cuda")
    torch.rand(50, device="cuda")  # move the generator on
    C._set_rng_state(state)
    assert torch.equal(torch.rand(5, device="cuda"), expected)


@pytest.mark.gpu
def test_host_sync_counter_counts_cuda_synchronize():
    """``HostSyncCounter`` wraps the real ``torch.cuda.synchronize`` (and the tensor syncs) for
    calls made from hdet_megatron files only."""
    import hdet_megatron
    from hdet_megatron.megatron.sync_counter import HostSyncCounter

    inside = os.path.join(os.path.dirname(hdet_megatron.__file__), "_gpu_probe.py")
    code = compile("torch.cuda.synchronize(); x.item(); x.cpu()", inside, "exec")
    x = torch.ones((), device="cuda")
    with HostSyncCounter() as counter:
        exec(code, {"torch": torch, "x": x})
        torch.cuda.synchronize()  # from this test file: not counted
        x.item()
    assert dict(counter.counts) == {"cuda.synchronize": 1, "Tensor.item": 1, "Tensor.cpu": 1}
    assert torch.cuda.synchronize.__module__ == "torch.cuda"  # unwrapped again


@pytest.mark.gpu
@pytest.mark.skipif(CUDA and not _te_available(), reason="Transformer Engine is not installed")
def test_module_axes_drive_transformer_engine_attention():
    """HDET's module axes write TE ``DotProductAttention.softmax_scale`` and
    ``.attention_dropout``, and TE's forward uses the written values."""
    import math

    import transformer_engine.pytorch as te

    from hdet_megatron.config import Axis, HDETConfig
    from hdet_megatron.megatron.module_axes import ModuleAxes

    heads, dim, seq, batch = 4, 32, 64, 2
    torch.manual_seed(0)
    attn = te.DotProductAttention(
        heads, dim, attention_dropout=0.2, attn_mask_type="causal", qkv_format="sbhd"
    ).cuda()
    q, k, v = (torch.randn(seq, batch, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def reference(scale: float) -> torch.Tensor:
        qf, kf, vf = (t.float().permute(1, 2, 0, 3) for t in (q, k, v))  # b h s d
        scores = qf @ kf.transpose(-1, -2) * scale
        mask = torch.ones(seq, seq, device="cuda", dtype=torch.bool).triu(1)
        out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ vf
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return attn(q, k, v).float()

    base_scale = 1.0 / math.sqrt(dim)
    config = HDETConfig(axes=(Axis("dropout", 0.15, min=0.0, max=0.9), Axis("attention_temperature", 0.5)))
    axes = ModuleAxes([attn], config, arm=0)
    kinds = {(t.axis, t.attr) for t in axes.targets}
    assert ("attention_temperature", "softmax_scale") in kinds
    assert ("dropout", "attention_dropout") in kinds
    attn.eval()
    out_base = run()
    assert torch.allclose(out_base, reference(base_scale), atol=3e-2, rtol=3e-2)
    # arm 0 of 2 under spread 0.5: tau = 0.5, dropout 0.2 - 0.15
    spread = {"attention_temperature": [0.5, 1.5], "dropout": [-0.15, 0.15]}
    axes.apply({"attention_temperature": 1.0, "dropout": 0.0}, spread)
    assert attn.softmax_scale == pytest.approx(base_scale / 0.5)
    assert attn.attention_dropout == pytest.approx(0.05)
    out_tau = run()
    assert torch.allclose(out_tau, reference(base_scale / 0.5), atol=3e-2, rtol=3e-2)
    assert not torch.allclose(out_tau, reference(base_scale), atol=3e-2, rtol=3e-2)
    # dropout: in training mode TE reads attention_dropout at forward time.
    attn.train()
    for t in axes.targets:
        if t.axis == "dropout":
            t.write(0.0)
    assert torch.allclose(run(), out_tau, atol=1e-3), "train mode with dropout 0 must equal eval"
    axes.apply({"attention_temperature": 1.0, "dropout": 0.0}, {**spread, "dropout": [0.7, -0.7]})
    assert attn.attention_dropout == pytest.approx(0.9)  # 0.2 + 0.7, clipped to the axis max
    assert not torch.allclose(run(), out_tau, atol=1e-2)
    axes.restore()
    attn.eval()
    assert attn.softmax_scale == base_scale and attn.attention_dropout == 0.2
    assert torch.equal(run(), out_base)


# -- multi-rank worlds on the one GPU (gloo with CUDA tensors; see tests/gpu_worker.py) ------------


def _torchrun(tmp_path, *args: str, nproc: int = 2, timeout: float = 300) -> list[dict]:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        os.path.join(ROOT, "tests", "gpu_worker.py"),
        args[0],
        str(out),
        *args[1:],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.gpu
def test_bucketed_averager_on_cuda_tensors(tmp_path):
    results = _torchrun(tmp_path, "averager")
    for r in results:
        assert r["device"].startswith("cuda")
        assert r["err_fp32"] < 1e-5
        assert r["err_bf16_rel"] < 1e-2
        assert r["err_weighted"] < 1e-4
    assert len({r["digest"] for r in results}) == 1  # every rank ends with the same bits
    assert len({r["weighted_digest"] for r in results}) == 1


@pytest.mark.gpu
def test_copying_path_bits_match_the_per_segment_code_on_cuda():
    """Issue 36's copying path (views built once, multi-tensor pack, small runs divided in place
    and copied out) against the per-segment code it replaced, on CUDA tensors: the division by
    a host scalar is a multiply by its reciprocal on CUDA (a true division on CPU), and every
    path must take the same one."""
    from tests.harness import run_world
    from tests.test_averaging import copy_path_world

    ((cases, paths),) = run_world(1, copy_path_world, "cuda", timeout=180)
    assert cases == 4 * 7 and paths["divide_into"] > 0 and paths["runs"] > 0


@pytest.mark.gpu
def test_hdet_one_cycle_lr_on_cuda(tmp_path):
    """The torch-native scheduler on CUDA params: arms diverge inside a window, agree bit for bit
    after each converge, and a non-converge step makes no host sync from hdet_megatron."""
    r0, r1 = _torchrun(tmp_path, "torch_scheduler")
    assert r0["param_devices"] == r1["param_devices"] and r0["param_devices"][0].startswith("cuda")
    assert r0["converges"] == r1["converges"] == [3, 6]
    for step in (3, 6):
        assert r0["digests"][step - 1] == r1["digests"][step - 1]
    assert r0["digests"][1] != r1["digests"][1]  # inside the first window the arms differ
    assert r0["lrs"][0] != r1["lrs"][0]  # different LRs per arm
    assert r0["syncs_non_converge"] == {} and r1["syncs_non_converge"] == {}


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_hdet_bf16_distributed_optimizer_on_cuda(tmp_path, impl):
    """Megatron GPT on CUDA, bf16, distributed optimizer (one instance per arm), 2 arms with lr,
    dropout and attention-temperature axes: every converge leaves identical fp32 main params on
    both arms, and a non-converge step makes no host sync from hdet_megatron."""
    if impl == "transformer_engine" and not _te_available():
        pytest.skip("Transformer Engine is not installed")
    results = _torchrun(tmp_path, "hdet", *(["--te"] if impl == "transformer_engine" else []))
    r0 = results[0]
    assert r0["param_devices"] and all(d.startswith("cuda") for d in r0["param_devices"])
    assert r0["main_dtypes"] == ["torch.float32"]
    assert len(r0["window_main_digests"]) == 2  # converges after steps 3 and 6
    windows = r0["all_window_main_digests"]
    assert windows[0] == windows[1], "arms differ after a converge"
    assert r0["syncs_non_converge"] == {}
    targets = " ".join(r0["module_axis_targets"])
    assert "softmax_scale" in targets and "dropout" in targets
    if impl == "transformer_engine":
        assert "TEDotProductAttention.softmax_scale" in targets
    assert all(x == x and x < 20 for r in results for x in r["losses"])  # finite


# -- the example's device flags (checked before any process group) ------------------------------


@pytest.fixture(scope="module")
def pretrain_gpt():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "pretrain_gpt_device_flags", os.path.join(ROOT, "examples", "pretrain_gpt", "pretrain_gpt.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _usage_error(pg, argv) -> str:
    with pytest.raises(pg.UsageError) as info:
        pg.parse_args(["--mock-data", *argv], world_size=2)
    return str(info.value)


@pytest.mark.skipif(CUDA, reason="checks the CPU-only answers")
def test_example_device_flags_on_a_cpu_machine(pretrain_gpt):
    pg = pretrain_gpt
    assert "no CUDA device" in _usage_error(pg, ["--device", "cuda"])
    assert "nccl needs CUDA" in _usage_error(pg, ["--distributed-backend", "nccl"])
    msg = _usage_error(pg, ["--transformer-impl", "transformer_engine"])
    if _te_available():
        assert "runs on CUDA only" in msg and "--transformer-impl local" in msg
    else:
        assert "needs NVIDIA Transformer Engine" in msg and "--transformer-impl local" in msg
    args, _ = pg.parse_args(["--mock-data", "--bf16", "--use-distributed-optimizer"], world_size=2)
    assert pg.resolve_device(args) == "cpu"


@pytest.mark.gpu
def test_example_device_flags_on_a_gpu_machine(pretrain_gpt):
    pg = pretrain_gpt
    args, _ = pg.parse_args(["--mock-data"], world_size=2)
    assert pg.resolve_device(args) == "cuda"
    args, _ = pg.parse_args(["--mock-data", "--distributed-backend", "gloo"], world_size=2)
    assert pg.resolve_device(args) == "cpu"  # as before --device existed
    args, _ = pg.parse_args(
        ["--mock-data", "--distributed-backend", "gloo", "--device", "cuda"], world_size=2
    )
    assert pg.resolve_device(args) == "cuda"
    assert "nccl needs CUDA" in _usage_error(pg, ["--device", "cpu", "--distributed-backend", "nccl"])
    if _te_available():
        args, _ = pg.parse_args(
            [
                "--mock-data",
                "--transformer-impl",
                "transformer_engine",
                "--bf16",
                "--use-distributed-optimizer",
            ],
            world_size=1,
        )
        assert args.transformer_impl == "transformer_engine"
        assert "runs on CUDA only" in _usage_error(
            pg, ["--transformer-impl", "transformer_engine", "--device", "cpu"]
        )


def test_gloo_cuda_adapter_matches_torch_on_cpu():
    """The coalescing-manager replacement for gloo-with-CUDA-tensors worlds (several ranks on one
    GPU), checked where it can be here: on CPU gloo its collectives give torch's results and
    Megatron DDP + DistOpt (overlapped grad reduce) trains to the same bits with it."""
    from tests.gpu_worker import gloo_adapter_equivalence
    from tests.harness import run_world

    r0, r1 = run_world(2, gloo_adapter_equivalence, timeout=180)
    for async_ops in (False, True):
        a, b, gathered, scattered = r0[f"async={async_ops}"]
        assert a == [3.0] * 4 and b == [30.0] * 3
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert scattered == [0.0, 3.0]  # rank 0's shard of sum_r arange(4) * (r + 1)
        assert r1[f"async={async_ops}"][3] == [6.0, 9.0]
    assert r0["installed"] is True and r0["installed_again"] is False
    assert r0["plain"] == r0["adapter"] and r1["plain"] == r1["adapter"]
    assert r0["issued"] > 0  # Megatron's grad reduce-scatter / param all-gather went through it
