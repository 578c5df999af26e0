"""Turns the single-device model into a trained one on any layout: the layout (dims.py: one
process or every process group, and the layout rules), the Engine protocol with the local
engine (engine.py) and the distributed one (distributed.py, with batching, ds_checkpoint,
ds_state, sampling_copy) built from tensor parallel (tp), pipeline stages and the
decoder-ring schedule (stage, pipeline) and ZeRO (zero, grads). Importing this package imports
neither megatron-core nor DeepSpeed; the modules that need them import them when used."""
