"""Turns the single-device model into a trained one: the local engine here; tensor, pipeline
and ZeRO data parallelism beside it."""
