"""Sampling: the rollout and replay schedules, logits processing, rewards."""

from rlt_mega.rollout.processing import Processing, draw_uniforms, make_generators, process_logits, sample
from rlt_mega.rollout.comms import Comms
from rlt_mega.rollout.sampler import Rollout, Sampler, SamplingParams, Schedule, generate, replay

__all__ = ["Processing", "draw_uniforms", "make_generators", "process_logits", "sample", "Comms", "Rollout",
           "Sampler", "SamplingParams", "Schedule", "generate", "replay"]
