"""Every command in the README's bash blocks names what exists: its script, its `rlt-mega`
subcommand (parsed by the CLI's own parser), its config file, and its overrides load into the
config (strict: a renamed key or an impossible value fails here before a newcomer meets it)."""

import re
import shlex
from pathlib import Path

import pytest

from rlt_mega.cli import COMMANDS, parse
from rlt_mega.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_TAKING_A_COMMAND = ("launch/torchrun.sh", "launch/deepspeed.sh", "launch/slurm.sbatch")


def readme_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks: continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def check_command(line: str) -> str:
    """Checks one command line; returns what it ran (for the failure message)."""
    stage = line.split("|")[-1] if "|" in line else line  # `echo ... | rlt-mega generate ...`
    words = shlex.split(stage)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:1] == ["source"]:
        assert (ROOT / words[1]).is_file(), f"{line}: no {words[1]}"
        return "source"
    if words[:1] == ["sbatch"]:
        words = ["bash"] + [w for w in words[1:] if not w.startswith("--nodes")]
    if words[:1] == ["bash"]:
        script, args = words[1], words[2:]
        assert (ROOT / script).is_file(), f"{line}: no script {script}"
        if script not in SCRIPTS_TAKING_A_COMMAND:
            assert script in ("launch/demo.sh", "launch/test.sh"), f"{line}: a script this test does not know"
            return script
        words = ["rlt-mega", env.get("COMMAND", "pretrain"), *args]
    assert words[0] == "rlt-mega", f"{line}: neither rlt-mega nor a launch script"
    args = parse(words[1:])  # argparse exits on an unknown subcommand or option
    if args.command in COMMANDS:  # the run commands: a config and dotted overrides
        assert args.config and (ROOT / args.config).is_file(), f"{line}: config {args.config} is missing"
        load_config(ROOT / args.config, args.overrides)
    for path in re.findall(r"(?:configs|launch|tests/data)/[\w./-]+", stage):
        assert (ROOT / path).exists(), f"{line}: {path} does not exist"
    return args.command


def test_every_readme_command_names_what_exists():
    commands = readme_commands((ROOT / "README.md").read_text())
    ran = [check_command(c) for c in commands]
    # the two commands and one quickstart per job are there
    assert "launch/demo.sh" in ran and "launch/test.sh" in ran
    for job in ("pretrain", "sft", "grpo", "eval", "generate", "export", "import", "params"):
        assert job in ran, f"README: no `rlt-mega {job}` command"


@pytest.mark.parametrize("line, problem", [
    ("rlt-mega pretrian --config configs/tiny_cpu.yaml", SystemExit),
    ("rlt-mega pretrain --config configs/tiny_cpu.yaml train.stpes=10", ValueError),
    ("rlt-mega sft --config configs/missing.yaml", AssertionError),
    ("bash launch/nothing.sh", AssertionError),
    ("COMMAND=grpo bash launch/torchrun.sh --config configs/demo_grpo.yaml grpo.advantage=none", ValueError),
])
def test_a_broken_command_is_caught(line, problem):
    with pytest.raises(problem):
        check_command(line)


def test_readme_links_and_figure_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert any(link.endswith(".png") for link in links), "README: the demo's figure is gone"
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    assert len(text.encode()) <= 10_000, "README over 10 KB: move the detail into docs/"
