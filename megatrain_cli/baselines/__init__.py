"""Baselines for `megatrain bench`: other systems training the same model, each in its own process."""
