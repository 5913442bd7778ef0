"""Everything in hdet_megatron that imports megatron.core lives in this package."""
