"""A multi-turn conversation whose user turns are scripted per prompt: the record's ``turns``
(a list of strings; GRPO's and eval's jsonl records carry it as a field, checked at load:
data/datasets.py ``prompt_record``). The model ends its turn (``end_of_turn``, or under a chat template the
template's turn-end token); the environment answers with the next scripted user turn (laid out
by the template, or as ``"\\nUser: {turn}\\nAssistant:"``) and ends the episode after the last one.
The template for users' own environments (tests use it too)."""

from __future__ import annotations

from rlt_mega.rollout.env.base import Environment, Turn


class Chat(Environment):
    end_of_turn = "<end>"
    turns = True

    @property
    def triggers(self) -> tuple[str, ...]:
        return (self.end_of_turn,)

    def start(self, record: dict) -> dict:
        turns = record.get("turns")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"the chat environment needs a record with 'turns': a list of strings (got {turns!r})")
        return {"turns": list(turns), "next": 0}

    def step(self, state: dict, text: str) -> Turn:
        if state["next"] >= len(state["turns"]):
            return Turn(done=True)
        turn = state["turns"][state["next"]]
        state["next"] += 1
        return Turn(observation=turn, role="user")
