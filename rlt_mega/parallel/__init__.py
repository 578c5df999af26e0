"""Turns the single-device RLT into a distributed one: process groups (dims), tensor parallel
(tp), pipeline stages and the decoder-ring schedule (stage, pipeline), ZeRO (zero), and the
engine the trainers call (engine). Importing this package imports neither megatron-core nor
DeepSpeed; the modules that need them import them when used."""
