"""Sampling: the rollout and replay schedules, logits processing, rewards."""

from rlt_mega.rollout.processing import Processing, make_generators, process_logits, sample
from rlt_mega.rollout.sampler import Rollout, SamplingParams, Schedule, generate, precision, replay

__all__ = ["Processing", "make_generators", "process_logits", "sample", "Rollout", "SamplingParams",
           "Schedule", "generate", "precision", "replay"]
