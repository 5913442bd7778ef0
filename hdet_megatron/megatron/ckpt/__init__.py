"""The rooms of :mod:`hdet_megatron.megatron.checkpointing` (import that module, not these).

``state``: HDET's own checkpoint state (build, validate, runtime position, save preparation);
``resume``: the resume rules (what a load sets, which config wins); ``files``: Megatron-LM's
checkpoint layout, RNG, format detection and optimizer-state fixes; ``torch_dist``: the
``dist_checkpointing`` format; ``legacy``: the ``torch.save`` format. Importing this package
imports nothing, so the scheduler and the runtime can use ``state``/``resume`` without loading
the file formats.
"""
