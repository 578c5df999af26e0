"""The environment interface (``grpo.env``: a built-in name or ``module:Class``) and the episode
that runs one for one row under the limits of a run (rollout/turns.py is the sampler's side).

An ``Environment`` declares its triggers (stop strings; ``triggered`` may refine them) and answers
a triggered model turn with a ``Turn``: an observation (text, tokenized here once), or the end of
the episode. ``start`` makes a row's state from its prompt record. The limits (``EnvLimits``):
turns per episode, observation tokens per turn and per episode (longer observations are cut,
counted as truncated; with the episode's observation budget spent the episode ends at its next
trigger), and a time limit per call (past it: an error observation, counted).

Users write environments (``grpo.env=module:Class``), so their code's faults are the run's to
survive and to report (``EnvFaults``): an exception in ``start`` (the row's episode ends at its
first trigger) or ``step``, a ``step`` that answers with something other than a ``Turn``, an
observation that is not a string (each an error observation). Each kind is named once in the log
(class, method, exception) and every fault is counted (``env/faults``); a step with more than
``max_errors`` of them stops the run with one line naming each kind and its count."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlt_mega.log import get_logger
from rlt_mega.rollout.turns import Response

log = get_logger(__name__)


@dataclass(frozen=True)
class Turn:
    """An environment's answer: ``observation`` appended to the row (text), or ``done``."""

    observation: str = ""
    done: bool = False
    tool_call: bool = False
    error: bool = False
    # None: inline text (the calculator's); "user", "tool": a turn of that role, laid out by the
    # tokenizer's chat template (data.chat_template), else as "\nUser: ...\nAssistant:"
    role: Optional[str] = None


class Environment:
    """Subclass and override ``step`` (and ``start``, ``triggered``, ``triggers`` as needed)."""

    triggers: tuple[str, ...] = ()  # a model turn containing one of these hands over
    trigger_ids: tuple[int, ...] = ()  # ... or one of these token ids
    # Answers with whole turns (Turn.role): under a chat template the end of the assistant's
    # turn (its turn-end token, then no longer a stop token) is the trigger.
    turns: bool = False

    def start(self, record: dict) -> Any:
        """A row's episode state from its prompt's record (the dataset row)."""
        return None

    def triggered(self, text: str) -> bool:
        return any(t in text for t in self.triggers)

    def step(self, state: Any, text: str) -> Turn:
        """The answer to the model's turn ``text`` (its text since the last observation)."""
        raise NotImplementedError

    def pieces(self, transcript: str) -> list[tuple[str, bool]]:
        """A written episode (an SFT answer, ``sft.env``) cut into its pieces in order,
        ``(text, True)`` for each observation this environment would have appended, ``(text,
        False)`` for the model's text; an environment whose observations cannot be found in a
        transcript leaves this unimplemented."""
        raise NotImplementedError(f"{type(self).__name__} does not find its observations in a written answer "
                                  "(Environment.pieces)")


@dataclass(frozen=True)
class EnvLimits:
    max_turns: int = 8
    max_turn_tokens: int = 32  # observation tokens per turn
    max_episode_tokens: int = 256  # observation tokens per episode
    time_limit_s: float = 2.0  # per call
    max_errors: int = 8  # faults of the environment's code allowed in one step (EnvFaults; 0: never stop)

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"environment limit {name}={getattr(self, name)}: must be >= 1")
        if not self.time_limit_s > 0:
            raise ValueError(f"environment time limit {self.time_limit_s}: must be > 0 seconds")
        if self.max_errors < 0:
            raise ValueError(f"environment limit max_errors={self.max_errors}: must be >= 0 (0: never stop)")


class EnvFaults:
    """The faults of an environment's own code, by kind (method, exception type): each kind is
    logged once, when first seen, with its message; the counts since the last ``over_limit``
    name the kinds when too many stop the run. Recorded on the host thread that takes the
    answers (TP rank 0 for ``step``: rollout/comms.py ``once_in_tp``; every rank for ``start``)."""

    def __init__(self, env: "Environment", max_errors: int) -> None:
        cls = type(env)
        self.name = f"{cls.__module__}:{cls.__qualname__}"
        self.max_errors = max_errors
        self.counts: Counter = Counter()  # kind -> faults since the last over_limit
        self.first: dict[tuple[str, str], str] = {}  # kind -> its first message

    def record(self, method: str, error: str, message: str, kind: Optional[str] = None) -> None:
        """A fault of ``method``: the exception's type (``error``) and message; ``kind`` tells
        faults of one type apart (a TypeError raised, an answer of the wrong type)."""
        key = (method, kind or error)
        if key not in self.first:
            self.first[key] = f"{error}: {message}"
            log.warning("environment %s: %s failed (%s: %s); answered with an error observation and counted in "
                        "env/faults (each kind of fault is logged once)", self.name, method, error, message)
        self.counts[key] += 1

    def over_limit(self, faults: float) -> Optional[tuple[str, str]]:
        """After a step: (reason, hint) when its faults (``faults``: every replica's, the same
        figure on every rank) exceed max_errors, else None; the counts start again."""
        counts, self.counts = self.counts, Counter()
        if not self.max_errors or faults <= self.max_errors:
            return None
        kinds = "; ".join(f"{method} x{n}: {self.first[(method, kind)]}"
                          for (method, kind), n in counts.most_common())
        return (f"the environment grpo.env={self.name} failed {faults:.0f} times in one step, more than "
                f"grpo.max_env_errors={self.max_errors} ({kinds or 'on another rank'})",
                "Fix the environment's code (start() returns a row's state, step() a Turn whose observation is a "
                "str), or raise grpo.max_env_errors (0: never stop).")


class Call:
    """One environment call in flight on a daemon thread (``Calls.start``): ``turn()`` waits for
    it until its deadline (the time limit from the call's start) -> what it returned, or None (it
    raised: ``error`` holds the exception; or it ran out of time: abandoned; Python cannot stop a
    thread, and a daemon one does not hold the process at exit, as a thread pool's worker would)."""

    def __init__(self, fn: Callable[[], Turn], time_limit_s: float) -> None:
        self._box: list = []
        self.error: Optional[Exception] = None
        self._deadline = time.monotonic() + time_limit_s

        def run() -> None:
            try:
                self._box.append(fn())
            except Exception as exc:  # an environment bug is an error observation, named and counted
                self.error = exc

        self._thread = threading.Thread(target=run, name="rlt-env-call", daemon=True)
        self._thread.start()
        self._turn: Optional[Turn] = None
        self._waited = False

    def turn(self) -> Any:
        if not self._waited:
            self._thread.join(max(0.0, self._deadline - time.monotonic()))
            self._turn, self._waited = (self._box[0] if self._box else None), True
        return self._turn


class Calls:
    """Starts an environment's calls under the time limit, each on its own daemon thread, so they
    run while the sampler decodes (rollout/turns.py: the row leaves its slot meanwhile)."""

    def __init__(self, time_limit_s: float) -> None:
        self.time_limit_s = time_limit_s

    def start(self, fn: Callable[[], Turn]) -> Call:
        return Call(fn, self.time_limit_s)


class Pending:
    """An episode's answer under way (``EnvEpisode.submit``): ``result()`` waits for it -> Response."""

    def __init__(self, call: Optional[Call], finish: Callable[[Call], Response],
                 now: Optional[Response] = None) -> None:
        self._call, self._finish, self._result = call, finish, now

    def result(self) -> Response:
        if self._result is None:
            self._result = self._finish(self._call)
        return self._result


class EnvEpisode:
    """One row's episode (rollout/turns.py ``Episode``): the environment's turns, the
    observations tokenized once (``encode``: text -> ids, no BOS), cut to the limits."""

    ERROR = "error>>"

    def __init__(self, env: Environment, record: dict, encode: Callable[[str], list[int]], limits: EnvLimits,
                 calls: Calls, chat_turn: Optional[Callable[[str, str], str]] = None,
                 turn_end_id: Optional[int] = None, faults: Optional[EnvFaults] = None) -> None:
        self.env, self.encode, self.limits, self.calls = env, encode, limits, calls
        self.chat_turn, self.turn_end_id = chat_turn, turn_end_id
        self.faults = faults if faults is not None else EnvFaults(env, limits.max_errors)
        self.start_failed = False
        try:
            self.state = env.start(record)
        except Exception as exc:  # the row samples on; its episode ends at its first trigger
            self.faults.record("start", type(exc).__name__, str(exc))
            self.state, self.start_failed = None, True
        self.turns = 0
        self.tokens = 0

    def triggered(self, ids: Sequence[int], text: str) -> bool:
        if self.chat_turn is not None and self.env.turns:
            return self.turn_end_id in ids
        return any(i in self.env.trigger_ids for i in ids) or self.env.triggered(text)

    def submit(self, ids: Sequence[int], text: str) -> Pending:
        """Starts the answer to a triggered turn (the environment's call runs on its own thread);
        past max_turns, or with the episode's observation budget spent, the episode ends without a
        call (truncated); so does an episode whose start failed."""
        if self.start_failed:
            return Pending(None, self._response, Response(done=True))  # (its fault counted at the start)
        if self.turns >= self.limits.max_turns or self.tokens >= self.limits.max_episode_tokens:
            return Pending(None, self._response, Response(done=True, truncated=True))
        self.turns += 1
        state = self.state
        return Pending(self.calls.start(lambda: self.env.step(state, text)), self._response)

    def respond(self, ids: Sequence[int], text: str) -> Response:
        """The answer to a triggered turn, waited for."""
        return self.submit(ids, text).result()

    def _response(self, call: Call) -> Response:
        """The call's Turn -> the response, the observation laid out and tokenized once, cut to
        the limits. A call that ran out of time, and a fault of the environment's code (it raised,
        answered with something other than a Turn, or an observation that is not a str: named
        and counted, ``fault``), are an error observation."""
        turn, fault = call.turn(), None
        if call.error is not None:
            fault = (type(call.error).__name__, str(call.error))
        elif turn is not None and not isinstance(turn, Turn):
            fault = ("TypeError", f"returned {type(turn).__name__} {_short(turn)}, not a Turn", "answer")
        elif turn is not None and not turn.done and not isinstance(turn.observation, str):
            fault = ("TypeError", f"returned an observation of type {type(turn.observation).__name__} "
                                  f"{_short(turn.observation)}, not a str", "observation")
        if fault is not None:
            self.faults.record("step", *fault)
        if turn is None or fault is not None:
            turn = Turn(observation=self.ERROR, tool_call=True, error=True)
        if turn.done:
            return Response(done=True, tool_call=turn.tool_call, error=turn.error)
        text = turn.observation
        if turn.role is not None:
            text = (self.chat_turn(turn.role, text) if self.chat_turn is not None else
                    f"\n{turn.role.capitalize()}: {text}\nAssistant:")
        obs = list(self.encode(text)) if text else []
        cap = min(self.limits.max_turn_tokens, self.limits.max_episode_tokens - self.tokens)
        self.tokens += min(len(obs), cap)
        return Response(ids=tuple(obs[:cap]), tool_call=turn.tool_call, error=turn.error, truncated=len(obs) > cap,
                        fault=fault is not None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Environments:
    """A run's environment: ``episodes(records)`` makes one episode per row."""

    def __init__(self, env: Environment, encode: Callable[[str], list[int]], limits: EnvLimits,
                 chat_turn: Optional[Callable[[str, str], str]] = None, turn_end_id: Optional[int] = None) -> None:
        """chat_turn, turn_end_id: the tokenizer's chat layout (``Tokenizer.chat_turn``), for
        environments that answer with turns."""
        self.env, self.encode, self.limits = env, encode, limits
        self.chat_turn, self.turn_end_id = (chat_turn, turn_end_id) if env.turns else (None, None)
        self.calls = Calls(limits.time_limit_s)
        self.faults = EnvFaults(env, limits.max_errors)

    def episodes(self, records: Sequence[dict]) -> list[EnvEpisode]:
        return [EnvEpisode(self.env, r, self.encode, self.limits, self.calls, self.chat_turn, self.turn_end_id,
                           self.faults) for r in records]

    def over_limit(self, faults: float) -> Optional[tuple[str, str]]:
        """After a step with ``faults`` faults of the environment's code (``env/faults``, the same
        on every rank): (reason, hint) to stop the run with, or None (``EnvFaults.over_limit``)."""
        return self.faults.over_limit(faults)

    def stop_ids(self, ids: Sequence[int]) -> tuple[int, ...]:
        """The sampling's stop tokens less the turn end that hands over to the environment."""
        return tuple(i for i in ids if self.chat_turn is None or i != self.turn_end_id)
