"""An indexed dataset whose .idx entries are damaged while its header is intact (pointers and
lengths that disagree, a negative length, document indices out of order) is refused when the
run opens it, with one line naming the .idx as damaged, before any step."""

import numpy as np
import pytest

from rlt_mega.cli import main

from helpers import TINY, make_prefix

HEADER = 34


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    prefix, _ = make_prefix(tmp, "corpus", num_docs=60, bad_lines=False)
    return prefix


def damage(prefix, tmp_path, how):
    """A copy of the dataset with one .idx entry changed in place (same size, same header)."""
    out = tmp_path / "copy"
    for ext in (".bin", ".idx", ".json"):
        out.with_suffix(ext).write_bytes(open(prefix + ext, "rb").read())
    raw = bytearray(out.with_suffix(".idx").read_bytes())
    num_seqs = int(np.frombuffer(bytes(raw[18:26]), np.int64)[0])
    lengths = np.frombuffer(raw, np.int32, num_seqs, HEADER)
    pointers = np.frombuffer(raw, np.int64, num_seqs, HEADER + 4 * num_seqs)
    documents = np.frombuffer(raw, np.int64, offset=HEADER + 12 * num_seqs)
    if how == "swapped lengths":  # the total is unchanged: the .bin size still matches
        lengths[[4, 5]] = lengths[[5, 4]] if lengths[4] != lengths[5] else (lengths[4] + 1, lengths[5] - 1)
    elif how == "pointer":
        pointers[7] += 2
    elif how == "negative length":
        lengths[2] = -lengths[2]
    else:
        documents[[1, 2]] = documents[[2, 1]]
    out.with_suffix(".idx").write_bytes(bytes(raw))
    return str(out)


@pytest.mark.parametrize("how", ["swapped lengths", "pointer", "negative length", "document indices"])
def test_a_damaged_index_is_one_line(dataset, tmp_path, capsys, how):
    prefix = damage(dataset, tmp_path, how)
    args = ["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, f"data.train={prefix}", "train.steps=1",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlt-mega pretrain: error: {prefix}.idx is damaged (its header is intact): ") \
        and err.count("\n") == 1, err
    assert not (tmp_path / "ckpt").exists()
