"""Dotted overrides may follow an option (``rlt-mega eval --limit 4 train.seed=1``); an unknown
option is still an argparse error."""

import pytest

from rlt_mega.cli import parse


def test_overrides_before_and_after_options_keep_their_order():
    args = parse(["eval", "a.b=1", "--limit", "4", "x.y=2", "--output", "o.jsonl", "x.y=3"])
    assert args.limit == 4 and args.output == "o.jsonl"
    assert args.overrides == ["a.b=1", "x.y=2", "x.y=3"]  # the later x.y wins when applied
    assert parse(["grpo", "--config", "c.yaml", "train.steps=2"]).overrides == ["train.steps=2"]


def test_unknown_options_are_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["eval", "--limit", "4", "--bogus", "x.y=1"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["inspect", "ckpt", "x.y=1"])  # a tool without overrides
