"""Sampled evaluation: pass@k against a hand-computed case and brute-force enumeration of the
k-subsets of n samples, maj@k's votes and ties, and `rlt-mega eval` reporting every figure
named by its k and n."""

import itertools
import json
import math
from fractions import Fraction

import pytest

from rlt_mega.rollout.evaluation import majority, maj_at_k, metric_names, pass_at_k, problem_scores


def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0 and pass_at_k(5, 5, 5) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
            assert math.comb(n, k) == len(subsets)


def test_majority_votes_and_ties():
    F = Fraction
    assert majority([F(3), F(4), F(4), None]) == F(4)
    assert majority([F(5), F(3), F(3), F(5)]) == F(5)  # tie: the answer that came first
    assert majority([None, None]) is None
    answers = [F(1), F(2), F(2), None]
    # k = 1: each sample alone; k = 3: the subsets {0,1,2}, {0,1,3}, {0,2,3}, {1,2,3} vote
    # 2, 1 (tie 1 / 2, 1 came first), 1 (the same) and 2
    assert maj_at_k(answers, F(2), 1) == pytest.approx(0.5)
    assert maj_at_k(answers, F(2), 3) == pytest.approx(0.5)
    assert maj_at_k(answers, F(1), 3) == pytest.approx(0.5)
    assert maj_at_k(answers, F(1), 4) == 0.0


def test_problem_scores_are_named_by_k_and_n():
    scores = problem_scores([Fraction(1), Fraction(2), Fraction(2), Fraction(2)], Fraction(1), [1, 2])
    assert set(scores) == set(metric_names(4, [1, 2])) == {"eval/pass@1_n4", "eval/pass@2_n4", "eval/maj@1_n4",
                                                             "eval/maj@2_n4", "eval/mean@4"}
    assert scores["eval/pass@1_n4"] == pytest.approx(0.25) and scores["eval/pass@2_n4"] == pytest.approx(0.5)
    # maj@2: the pairs with sample 0 tie and vote its 1 (3 of 6), the others vote 2
    assert scores["eval/mean@4"] == 0.25 and scores["eval/maj@2_n4"] == pytest.approx(3 / 6)


def test_eval_cli_reports_sampled_figures(tmp_path, capsys):
    from rlt_mega.checkpoint_tools.export import export_model
    from rlt_mega.cli import main
    from rlt_mega.config import ModelConfig
    from rlt_mega.model.rlt import build_model

    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(3)))
    model = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2", "model.max_seq_len=32"]
    weights = tmp_path / "export"
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, memory_block=2, max_seq_len=32)
    export_model(build_model(cfg), cfg, weights)
    args = ["eval", *model, f"train.init_from={weights}", "data.seq_len=16", "sampling.max_new_tokens=4",
            "eval.samples=3", "eval.k=[1,3]", "eval.temperature=1.0", "--data", str(data)]
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("greedy accuracy", "pass@1_n3:", "pass@3_n3:", "maj@1_n3:", "maj@3_n3:", "mean@3:"):
        assert name in out, out
    assert main(args[:-4] + ["eval.samples=2", "eval.k=[4]", "--data", str(data)]) == 2
    assert "every k must be <= eval.samples" in capsys.readouterr().err
