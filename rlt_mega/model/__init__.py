"""The network and its one decoder step, on one device: knows nothing of ranks, process groups
or the row schedule (whose layouts it is handed as arguments). Import from the modules:
``rlt_mega.model.rlt`` (RLT, build_model, param_counts, vis)."""
