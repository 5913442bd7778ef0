"""Everything in hdet_megatron that imports megatron.core lives in this package.

Importing it applies the CPU shims first (a no-op on machines with CUDA).
"""

from hdet_megatron.megatron.cpu import apply_cpu_shims

apply_cpu_shims()

__all__ = ["ArmLayout", "HDET", "HDETOptimizerParamScheduler", "HDETSetupError"]


def __getattr__(name):
    # Lazy: `import hdet_megatron.megatron.cpu` alone must not import megatron.core modules.
    if name in ("ArmLayout", "HDETSetupError"):
        from hdet_megatron.megatron import layout

        return getattr(layout, name)
    if name == "HDETOptimizerParamScheduler":
        from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

        return HDETOptimizerParamScheduler
    if name == "HDET":
        from hdet_megatron.megatron.runtime import HDET

        return HDET
    raise AttributeError(name)
