"""The environment interface (``grpo.env``: a built-in name or ``module:Class``) and the episode
that runs one for one row under the limits of a run (rollout/turns.py is the sampler's side).

An ``Environment`` declares its triggers (stop strings; ``triggered`` may refine them) and answers
a triggered model turn with a ``Turn``: an observation (text, tokenized here once), or the end of
the episode. ``start`` makes a row's state from its prompt record. The limits (``EnvLimits``):
turns per episode, observation tokens per turn and per episode (longer observations are cut,
counted as truncated; with the episode's observation budget spent the episode ends at its next
trigger), and a time limit per call (past it: an error observation, counted)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlt_mega.rollout.turns import Response


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

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"environment limit {name}={getattr(self, name)}: must be >= 1")
        if not self.time_limit_s > 0:
            raise ValueError(f"environment time limit {self.time_limit_s}: must be > 0 seconds")


class Call:
    """One environment call in flight on a daemon thread (``Calls.start``): ``turn()`` waits for
    it until its deadline (the time limit from the call's start) -> its Turn, or None (it raised,
    or ran out of time: abandoned; Python cannot stop a thread, and a daemon one does not hold the
    process at exit, as a thread pool's worker would)."""

    def __init__(self, fn: Callable[[], Turn], time_limit_s: float) -> None:
        self._box: list = []
        self._deadline = time.monotonic() + time_limit_s

        def run() -> None:
            try:
                self._box.append(fn())
            except Exception:  # an environment bug is an error observation, counted, never a dead run
                pass

        self._thread = threading.Thread(target=run, name="rlt-env-call", daemon=True)
        self._thread.start()
        self._turn: Optional[Turn] = None
        self._waited = False

    def turn(self) -> Optional[Turn]:
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

    def __init__(self, call: Optional[Call], finish: Callable[[Optional[Turn]], Response],
                 now: Optional[Response] = None) -> None:
        self._call, self._finish, self._result = call, finish, now

    def result(self) -> Response:
        if self._result is None:
            self._result = self._finish(self._call.turn())
        return self._result


class EnvEpisode:
    """One row's episode (rollout/turns.py ``Episode``): the environment's turns, the
    observations tokenized once (``encode``: text -> ids, no BOS), cut to the limits."""

    ERROR = "error>>"

    def __init__(self, env: Environment, record: dict, encode: Callable[[str], list[int]], limits: EnvLimits,
                 calls: Calls, chat_turn: Optional[Callable[[str, str], str]] = None,
                 turn_end_id: Optional[int] = None) -> None:
        self.env, self.encode, self.limits, self.calls = env, encode, limits, calls
        self.chat_turn, self.turn_end_id = chat_turn, turn_end_id
        self.state = env.start(record)
        self.turns = 0
        self.tokens = 0

    def triggered(self, ids: Sequence[int], text: str) -> bool:
        if self.chat_turn is not None and self.env.turns:
            return self.turn_end_id in ids
        return any(i in self.env.trigger_ids for i in ids) or self.env.triggered(text)

    def submit(self, ids: Sequence[int], text: str) -> Pending:
        """Starts the answer to a triggered turn (the environment's call runs on its own thread);
        past max_turns, or with the episode's observation budget spent, the episode ends without a
        call (truncated)."""
        if self.turns >= self.limits.max_turns or self.tokens >= self.limits.max_episode_tokens:
            return Pending(None, self._response, Response(done=True, truncated=True))
        self.turns += 1
        state = self.state
        return Pending(self.calls.start(lambda: self.env.step(state, text)), self._response)

    def respond(self, ids: Sequence[int], text: str) -> Response:
        """The answer to a triggered turn, waited for."""
        return self.submit(ids, text).result()

    def _response(self, turn: Optional[Turn]) -> Response:
        """The call's Turn (None: it failed or ran out of time) -> the response, the observation
        laid out and tokenized once, cut to the limits."""
        if turn is None:
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
        return Response(ids=tuple(obs[:cap]), tool_call=turn.tool_call, error=turn.error, truncated=len(obs) > cap)


class Environments:
    """A run's environment: ``episodes(records)`` makes one episode per row."""

    def __init__(self, env: Environment, encode: Callable[[str], list[int]], limits: EnvLimits,
                 chat_turn: Optional[Callable[[str, str], str]] = None, turn_end_id: Optional[int] = None) -> None:
        """chat_turn, turn_end_id: the tokenizer's chat layout (``Tokenizer.chat_turn``), for
        environments that answer with turns."""
        self.env, self.encode, self.limits = env, encode, limits
        self.chat_turn, self.turn_end_id = (chat_turn, turn_end_id) if env.turns else (None, None)
        self.calls = Calls(limits.time_limit_s)

    def episodes(self, records: Sequence[dict]) -> list[EnvEpisode]:
        return [EnvEpisode(self.env, r, self.encode, self.limits, self.calls, self.chat_turn, self.turn_end_id)
                for r in records]

    def stop_ids(self, ids: Sequence[int]) -> tuple[int, ...]:
        """The sampling's stop tokens less the turn end that hands over to the environment."""
        return tuple(i for i in ids if self.chat_turn is None or i != self.turn_end_id)
