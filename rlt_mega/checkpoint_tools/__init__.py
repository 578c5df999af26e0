"""Checkpoint tools (docs/design.md, "Checkpoints"): the layout-independent export format,
import of dense Llama/Qwen2 checkpoints, and inspection. They sit after checkpointing in the data flow: they
read what the trainers and rlt_mega.checkpoint write, and nothing to their left imports them
except through ``init_from``."""

from rlt_mega.checkpoint_tools.export import (
    export_model, export_state_dict, init_from, init_stage_from, load_exported, read_config, verify_export,
)
from rlt_mega.checkpoint_tools.files import CheckpointFormatError
from rlt_mega.checkpoint_tools.hf_import import convert_hf, import_hf

__all__ = ["CheckpointFormatError", "convert_hf", "export_model", "export_state_dict", "import_hf",
           "init_from", "init_stage_from", "load_exported", "read_config", "verify_export"]
