"""Import megatron.core with the CPU shims applied (for process pools that fork workers)."""

import warnings

# Worker pools: megatron warns loudly about missing Apex/TE and deprecations at import.
warnings.simplefilter("ignore")

from hdet_megatron.megatron.cpu import apply_cpu_shims  # noqa: E402

apply_cpu_shims()

import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
