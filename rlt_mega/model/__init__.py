"""Single-device model code: knows nothing of ranks or process groups."""

from rlt_mega.model.rlt import RLT, build_model, param_counts, vis

__all__ = ["RLT", "build_model", "param_counts", "vis"]
