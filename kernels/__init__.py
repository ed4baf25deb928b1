"""Triton kernels, installed as `megatrain_cli.kernels` (see pyproject's package-dir)."""
