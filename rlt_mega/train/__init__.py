"""Trainers: short loops over named phases that orchestrate data, engine, metrics, checkpoints."""
