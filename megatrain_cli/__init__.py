"""MegaTrain: full fine-tuning of large language models on one GPU, state in host memory."""

__version__ = "0.1.0"
