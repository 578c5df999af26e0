"""Environments for multi-turn and tool-calling rollouts (rollout/turns.py: how the sampler
inserts their observations). Built in: ``calculator`` (GSM8K's ``<<expression=value>>``) and
``chat`` (scripted user turns)."""

from __future__ import annotations

from rlt_mega.rollout.env.base import Calls, EnvEpisode, EnvFaults, EnvLimits, Environment, Environments, Turn
from rlt_mega.rollout.env.calculator import Calculator
from rlt_mega.rollout.env.chat import Chat
from rlt_mega.rollout.rewards import resolve_named

ENVIRONMENTS = {"calculator": Calculator, "chat": Chat}


def resolve_env(spec: str) -> Environment:
    """A built-in environment's name or "package.module:Class" (an ``Environment`` subclass)."""
    cls = resolve_named(spec, ENVIRONMENTS, "grpo.env", "package.module:Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"grpo.env {spec!r} is not a subclass of rlt_mega.rollout.env.Environment")
    return cls()


__all__ = ["Calls", "EnvEpisode", "EnvFaults", "EnvLimits", "Environment", "Environments", "Turn", "Calculator", "Chat",
           "ENVIRONMENTS", "resolve_env"]
