"""Every command the documentation shows is one that works: each `rlt-mega` command (typed, or
run by launch/torchrun.sh, launch/deepspeed.sh, launch/slurm.sbatch or srun) parses with the
real CLI, its config loads with its overrides (an unknown key, a wrong type or an impossible
value fails), the environment variables given to a launcher are ones it reads, the files it
names exist, and where the page says how many processes run, the layout fits them (the check
every rank runs before any work). `rlt-mega plan` commands run (no GPU needed)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from rlt_mega import cli
from rlt_mega.config import ConfigError, load_config
from rlt_mega.parallel.dims import resolve_layout
from rlt_mega.train.grpo import check_roles_layout

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
LAUNCHERS = {"launch/torchrun.sh", "launch/deepspeed.sh", "launch/slurm.sbatch"}
TOOL_SCRIPTS = {"tools/gpu_check.sh", "tools/gpu_check_multi.sh"}


def page_commands(page: Path) -> list[tuple[int, str]]:
    """(line, command) for each command of the page's shell blocks: continuations joined,
    comments dropped, pipelines split at `|` (the part that runs rlt-mega is kept)."""
    out, block, joined, start = [], False, "", 0
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = bool(FENCE.match(line)) and not block
            continue
        if not block:
            continue
        if not joined:
            start = n
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        words = shlex.split(joined, comments=True)
        joined = ""
        if not words:
            continue
        pipeline = [[]]
        for w in words:
            pipeline.append([]) if w in ("|", "&&") else pipeline[-1].append(w)
        out += [(start, shlex.join(part)) for part in pipeline if part]
    return out


def every_command() -> list[tuple[str, str]]:
    return [(f"docs/{p.relative_to(DOCS)}:{n}", c) for p in sorted(DOCS.rglob("*.md")) for n, c in page_commands(p)]


def split_env(words: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words[0].split("=", 1)
        env[k] = v
        words = words[1:]
    return env, words


def rlt_mega_argv(words: list[str]) -> tuple[dict, list[str] | None, int | None]:
    """(environment, the rlt-mega arguments, the processes launched when the command says) for a
    command that runs rlt-mega; (env, None, None) for one that does not."""
    env, words = split_env(words)
    if not words:
        return env, None, None
    if words[0] == "srun":  # srun [options] rlt-mega ...
        i = next((i for i, w in enumerate(words) if w == "rlt-mega"), None)
        return env, (words[i + 1:] if i is not None else None), 1
    if words[0] == "rlt-mega":
        return env, words[1:], 1
    if words[0] == "sbatch":
        i = next(i for i, w in enumerate(words) if not w.startswith("-") and i > 0)
        script, nodes = words[i], next((int(w.split("=")[1]) for w in words[1:i] if w.startswith("--nodes=")), 1)
        assert script in LAUNCHERS, f"sbatch runs {script}, not a launcher of launch/"
        gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", (ROOT / script).read_text()).group(1))
        return env, [env.get("COMMAND", "pretrain")] + words[i + 1:], nodes * gpus
    if words[0] == "bash" and words[1] in LAUNCHERS:
        script = (ROOT / words[1]).read_text()
        for k in env:
            assert k in ("COMMAND", "OMP_NUM_THREADS") or "${" + k in script or "$" + k in script, \
                f"{words[1]} does not read {k}"
        world = None
        if "HOSTFILE" in env:
            world = sum(int(m) for m in re.findall(r"slots=(\d+)", (ROOT / env["HOSTFILE"]).read_text()))
        elif "NPROC_PER_NODE" in env:
            world = int(env.get("NNODES", 1)) * int(env["NPROC_PER_NODE"])
        if int(env.get("NNODES", 1)) > 1:
            assert "RDZV_ENDPOINT" in env, "a multi-node torchrun needs RDZV_ENDPOINT"
        return env, [env.get("COMMAND", "pretrain")] + words[2:], world
    return env, None, None


def check_layout(cfg, world: int) -> None:
    """What every rank checks first: the layout against the processes launched (under the roles,
    the learner's tp x pp x dp ranks and R sampler replicas of tp x pp: train/grpo.py)."""
    if cfg.grpo.sampler_replicas:
        check_roles_layout(cfg, world)
        n = cfg.parallel.tp * cfg.parallel.pp
        assert resolve_layout(cfg.parallel, cfg.model, n * (cfg.parallel.dp or 1))[:2] == (cfg.parallel.tp,
                                                                                          cfg.parallel.pp)
    else:
        resolve_layout(cfg.parallel, cfg.model, world)


def check(command: str) -> None:
    words = shlex.split(command)
    env, argv, world = rlt_mega_argv(words)
    if argv is None:
        rest = split_env(words)[1]
        if rest[:1] == ["bash"] and rest[1] in TOOL_SCRIPTS:
            script = (ROOT / rest[1]).read_text()
            for flag in rest[2:]:
                if flag.startswith("-"):
                    assert f"{flag})" in script, f"{rest[1]} has no option {flag}"
        for w in rest:  # the repository's files a command names exist
            if re.fullmatch(r"(configs|launch|tools)/[\w./-]+\.(yaml|sh|sbatch|py|example)", w):
                assert (ROOT / w).is_file(), f"{w} does not exist"
        return
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = cli.parse(argv)
        except SystemExit:
            raise AssertionError(f"rlt-mega {shlex.join(argv)}: {err.getvalue().strip().splitlines()[-1]}")
    config = getattr(args, "config", None)
    if config:
        assert (ROOT / config).is_file(), f"{config} does not exist"
    if hasattr(args, "overrides") and args.command != "plan":
        try:
            cfg = load_config(str(ROOT / config) if config else None, args.overrides)
        except ConfigError as e:
            raise AssertionError(f"its config does not load: {e}") from None
        if world is not None and args.command in ("pretrain", "sft", "grpo"):
            try:
                check_layout(cfg, world)
            except ConfigError as e:
                raise AssertionError(f"its layout does not fit {world} processes: {e}") from None


COMMANDS = every_command()


def test_the_docs_show_commands_and_the_cluster_page_covers_every_job():
    cluster = [c for where, c in COMMANDS if where.startswith("docs/guide/cluster.md")]
    assert len(COMMANDS) > 50 and len(cluster) > 15
    for needed in ("COMMAND=sft", "COMMAND=grpo", "launch/slurm.sbatch", "launch/deepspeed.sh",
                   "NNODES=", "grpo.sampler_replicas=", "rlt-mega eval", "rlt-mega plan", "rlt-mega export",
                   "configs/grpo_gsm8k.yaml", "configs/rlt_48x48.yaml", "tools/gpu_check.sh",
                   "tools/gpu_check_multi.sh", "train.resume=auto"):
        assert any(needed in c for c in cluster), f"docs/guide/cluster.md shows no command with {needed}"


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_and_its_config_loads(where, command):
    try:
        check(command)
    except AssertionError as e:
        raise AssertionError(f"{where}: {command}\n  {e}") from None


def test_the_check_catches_a_wrong_command():
    for bad, why in [
        ("rlt-mega grpo --config configs/grpo_gsm8k.yaml grpo.sampler_replica=1", "sampler_replica"),
        ("rlt-mega sft --config configs/nope.yaml", "nope.yaml"),
        ("rlt-mega plan --config configs/rlt_48x48.yaml --hosts 8", "--hosts"),
        ("NPROC_PER_NODE=4 bash launch/torchrun.sh --config configs/grpo_gsm8k.yaml parallel.tp=4", "tp"),
        ("COMMAND=grpo NPROC_PER_NODE=8 bash launch/torchrun.sh --config configs/grpo_gsm8k.yaml "
         "parallel.tp=2 grpo.sampler_replicas=1", "runs on 4 processes"),
        ("NPROCS=8 bash launch/torchrun.sh --config configs/tiny_cpu.yaml", "NPROCS"),
        ("bash tools/gpu_check.sh --fast", "--fast"),
    ]:
        with pytest.raises(AssertionError, match=re.escape(why)):
            check(bad)
