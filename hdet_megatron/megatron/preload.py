"""Import megatron.core with the CPU shims applied (for process pools that fork workers)."""

from hdet_megatron.megatron.cpu import apply_cpu_shims

apply_cpu_shims()

import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
