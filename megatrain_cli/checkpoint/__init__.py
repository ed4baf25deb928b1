"""Training state on disk: resumable checkpoints (whole or per rank) and Hugging Face exports.

    format.py    bytes on disk: safetensors headers, CRC'd chunked I/O, fsync and atomic rename
    layout.py    a checkpoint directory: tile files, manifest, side files, publication, rotation
    whole.py     one process's checkpoints          sharded.py   N ranks' checkpoints, resharded reads
    load.py      reading any checkpoint into any store (picks whole's or sharded's reader)
    export.py    Hugging Face model directories
"""

from megatrain_cli.checkpoint.export import export_checkpoint, export_hf, export_sharded
from megatrain_cli.checkpoint.format import CheckpointError, CheckpointSettingError, CheckpointWriteError
from megatrain_cli.checkpoint.layout import checkpoints_newest_first, latest_checkpoint
from megatrain_cli.checkpoint.load import checkpoint_step, load_checkpoint, load_tiles
from megatrain_cli.checkpoint.sharded import save_sharded_checkpoint
from megatrain_cli.checkpoint.whole import save_checkpoint

__all__ = ["CheckpointError", "CheckpointSettingError", "CheckpointWriteError", "checkpoint_step", "checkpoints_newest_first",
           "export_checkpoint", "export_hf", "export_sharded", "latest_checkpoint", "load_checkpoint", "load_tiles",
           "save_checkpoint", "save_sharded_checkpoint"]
