"""hdet-megatron: Hyperparameter-Divergent Ensemble Training for Megatron-Core GPT pretraining."""

__version__ = "0.1.0"
