"""A config file with a key or a section given twice, or a tab in its indentation, is one line
naming the file and the lines through the CLI (PyYAML alone keeps the last duplicate silently:
a second `train:` section would reset the first one's keys)."""

import pytest

from rlt_mega.cli import main

CASES = {  # file text -> what follows "config file PATH" in the message
    "a section twice": ("train:\n  steps: 3\nmodel:\n  d_model: 32\ntrain:\n  seed: 1\n",
                        ": 'train' is given twice in the same section, on lines 1 and 5: keep one"),
    "a key twice": ("model:\n  d_model: 32\n  n_layers: 2\n  d_model: 64\n",
                    ": 'd_model' is given twice in the same section, on lines 2 and 4: keep one"),
    "a tab": ("model:\n  d_model: 32\n\tn_layers: 2\n",
              ", line 3: a tab in the indentation; YAML indents with spaces only"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["params", "pretrain"])
def test_config_file_errors_are_one_line(tmp_path, capsys, case, command):
    text, message = CASES[case]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main([command, "--config", str(path), f"checkpoint.dir={tmp_path / 'ckpt'}"]) == 2
    err = capsys.readouterr().err
    assert err == f"rlt-mega {command}: error: config file {path}{message}\n", err
    assert not (tmp_path / "ckpt").exists()


def test_merge_keys_are_not_duplicates(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {d_model: 32, n_layers: 2}\nmodel:\n  <<: *b\n  n_layers: 3\n")
    from rlt_mega.config import read_yaml
    assert read_yaml(path)["model"] == {"d_model": 32, "n_layers": 3}
