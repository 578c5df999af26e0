"""How often a command's set-up climbs back up the map of rooms (docs/design.md, "The map").

Runs one rlt-mega command in this process under a profiler until its first training step starts
(the loop's first ``job.step``) and records every call from one function of rlt_mega into another.
A call *climbs back* when the callee's room lies to the right of the caller's in the map: the
lower room calls into a room it was called from (a callback, a lambda handed down, a duck-typed
object of a higher room). A layered set-up calls only downwards, so each distinct climbing call
site (caller function -> callee function) is counted once, with its rooms. A call *re-enters*
when its callee's room is already on the stack below another room (train -> parallel -> train,
whichever way the map points): the path went back into a room it had left. Both are printed.

    PYTHONPATH=. python tools/setup_path.py            # GRPO on a tiny model (the default command)
    PYTHONPATH=. python tools/setup_path.py pretrain --config configs/tiny_cpu.yaml train.steps=1

Prints each climbing call site, then ``climbs: N`` and the rooms the set-up passed through."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the default command's reward function (tests/helpers.py)

ORDER = ["leaf", "model", "schedule", "parallel", "rollout", "learner", "data", "checkpoint_tools", "cost",
         "train", "cli"]
RANK = {room: i for i, room in enumerate(ORDER)}
RANK.update(data=6, checkpoint_tools=6, cost=6)  # one column of the map


def room(filename: str):
    """rlt_mega/parallel/tp.py -> parallel; rlt_mega/cli.py -> cli; rlt_mega/config.py -> leaf;
    None outside the package."""
    path = Path(filename)
    try:
        parts = path.resolve().relative_to(ROOT / "rlt_mega").parts
    except ValueError:
        return None
    if len(parts) > 1:
        return parts[0]
    return "cli" if parts[0] in ("cli.py", "__main__.py") else "leaf"


def default_command(tmp: Path) -> list[str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(8)))
    return ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2",
            "model.max_seq_len=64", f"data.train={prompts}", "data.seq_len=32", "train.steps=1",
            "logging.progress=false", f"checkpoint.dir={tmp / 'ckpt'}", f"logging.dir={tmp / 'tb'}",
            "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.eval_size=0", "grpo.reward=helpers:emit_seven",
            "sampling.max_new_tokens=4"]


class FirstStep(Exception):
    """Raised by the profiler when the loop calls the job's first step: the set-up is over."""


def trace(argv: list[str]):
    """-> ({(caller, callee): (caller room, callee room)} of the climbing calls, the same of the
    re-entering calls, the rooms visited in order)."""
    from rlt_mega.cli import main

    climbs: dict[tuple[str, str], tuple[str, str]] = {}
    reentries: dict[tuple[str, str], tuple[str, str]] = {}
    visited: list[str] = []
    stack: list[str] = []  # the rooms of the rlt_mega frames on the call stack

    def name(frame) -> str:
        return f"{frame.f_code.co_filename.split('rlt_mega/')[-1]}:{frame.f_code.co_name}"

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        callee = room(frame.f_code.co_filename)
        if callee is None:
            return
        if event == "return":
            stack.pop()
            return
        caller_frame = frame.f_back
        caller = room(caller_frame.f_code.co_filename) if caller_frame is not None else None
        stack.append(callee)
        if caller is None:
            return
        if not visited or visited[-1] != callee:
            visited.append(callee)
        if frame.f_code.co_name == "step" and caller_frame.f_code.co_filename.endswith("train/loop.py"):
            raise FirstStep
        if RANK[callee] > RANK[caller]:
            climbs.setdefault((name(caller_frame), name(frame)), (caller, callee))
        if callee != caller and callee in stack[:-1] and callee != "leaf":
            reentries.setdefault((name(caller_frame), name(frame)), (caller, callee))

    sys.setprofile(profile)
    try:
        main(argv)
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
    return climbs, reentries, visited


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        argv = sys.argv[1:] or default_command(Path(tmp))
        climbs, reentries, visited = trace(argv)
    for title, found in (("climbs", climbs), ("re-entries", reentries)):
        for (caller, callee), (a, b) in sorted(found.items()):
            print(f"{title}: {a} -> {b}: {caller} calls {callee}")
    print(f"climbs: {len(climbs)}")
    print(f"re-entries: {len(reentries)}")
    back = sum(1 for i in range(1, len(visited))
               if RANK[visited[i]] > RANK[visited[i - 1]] and visited[i] in visited[:i - 1])
    print(f"rooms visited in order (runs merged): {len(visited)}; of those, a call into a room further up the map "
          f"that the sequence had left before (after a return): {back}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
