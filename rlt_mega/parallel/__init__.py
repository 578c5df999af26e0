"""Turns the single-device model into a trained one: the local engine (engine.py); and the
distributed one (distributed.py) built from process groups (dims), tensor parallel (tp),
pipeline stages and the decoder-ring schedule (stage, pipeline) and ZeRO (zero). Importing
this package imports neither megatron-core nor DeepSpeed; the modules that need them import
them when used."""
