"""Training state on disk: resumable checkpoints (whole or per rank) and Hugging Face exports."""

from megatrain_cli.checkpoint.export import export_checkpoint, export_hf
from megatrain_cli.checkpoint.sharded import save_sharded_checkpoint
from megatrain_cli.checkpoint.whole import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "export_checkpoint", "export_hf", "latest_checkpoint", "load_checkpoint",
           "save_checkpoint", "save_sharded_checkpoint"]
