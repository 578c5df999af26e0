"""SFT's batches: the loss on answer tokens only, and the record order that resumes and reshuffles."""

import pytest

from rlt_mega.data.datasets import RecordOrder
from rlt_mega.data.pairs import answer_ids, prompt_ids
from rlt_mega.data.tokenizer import byte_level
from rlt_mega.loss import IGNORE
from rlt_mega.train.sft import sft_batch


def test_sft_batch_puts_loss_on_answer_tokens_only():
    tok = byte_level()
    p1, a1 = prompt_ids(tok, "2+3?"), answer_ids(tok, "#### 5")
    p2, a2 = prompt_ids(tok, "a longer question?"), answer_ids(tok, "#### 17")
    mb = sft_batch({"ids": [p1 + a1, p2 + a2], "num_prompt": [len(p1), len(p2)]}, pad_id=tok.pad_id)
    inputs, targets = mb["inputs"], mb["targets"]
    assert inputs.shape == targets.shape == (2, len(p2) + len(a2) - 1)
    for b, (p, a) in enumerate([(p1, a1), (p2, a2)]):
        assert (targets[b, :len(p) - 1] == IGNORE).all()  # no loss on the prompt
        assert targets[b, len(p) - 1:len(p) + len(a) - 1].tolist() == a  # answer + end-of-text
        assert (targets[b, len(p) + len(a) - 1:] == IGNORE).all()  # nor on padding
        assert inputs[b, :len(p) + len(a) - 1].tolist() == (p + a)[:-1]
    assert tok.decode(a1) == "#### 5" and a1[-1] == tok.eos_id and p1[0] == tok.eos_id


def test_record_order_resumes_and_reshuffles():
    order = RecordOrder(10, seed=3)
    first = [order.take(4) for _ in range(2)]
    state = order.state_dict()
    later = [order.take(4) for _ in range(3)]
    again = RecordOrder(10, seed=3)
    again.load_state_dict(state)
    assert [again.take(4) for _ in range(3)] == later
    assert len(set(first[0] + first[1])) == 8  # no repeats within an epoch
    with pytest.raises(ValueError, match="batch of 11"):
        order.take(11)


def episode_tokenizer():
    """A byte-level BPE without the pre-tokenizer's split at digits (as SentencePiece-style
    tokenizers have none), so merges cross the calculator's piece boundaries ("=3", ">>3"):
    encoding a whole transcript gives other ids than the pieces a rollout holds."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from rlt_mega.data.tokenizer import Tokenizer
    from rlt_mega.data.tokenizer_train import BOS, EOS, PAD

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[PAD, BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([f"<<({a}*7)={a * 7}>>{a * 7} <<{a * 7}+5={a * 7 + 5}>>" for a in range(10, 99)] * 4,
                           trainer=trainer)
    return Tokenizer(hf, "bpe-no-digit-split")


def test_sft_on_written_episodes_tokenizes_observations_alone_and_trains_on_the_models_pieces():
    import datasets

    from rlt_mega.data.datasets import DataStats
    from rlt_mega.data.packing import PackedPairs
    from rlt_mega.data.pairs import episode_pair_ids, tokenize_pairs
    from rlt_mega.rollout.env import Calculator

    tok, pieces = episode_tokenizer(), Calculator().pieces
    question, answer = "What is (50*7)+5?", "<<(50*7)=350>>350 <<350+5=355>>355\n#### 355"
    assert pieces(answer) == [("<<(50*7)=", False), ("350>>", True), ("350 <<350+5=", False), ("355>>", True),
                              ("355\n#### 355", False)]
    p, a, observed = episode_pair_ids(tok, question, answer, pieces)
    enc = [tok.encode(text) for text, _ in pieces(answer)]
    assert p == prompt_ids(tok, question) and a == [i for e in enc for i in e] + [tok.eos_id]
    first = len(enc[0])
    second = first + len(enc[1]) + len(enc[2])
    assert observed == [*range(first, first + len(enc[1])), *range(second, second + len(enc[3]))]
    assert tok.decode([a[i] for i in observed]) == "350>>355>>"
    assert a != answer_ids(tok, answer)  # the whole answer encodes otherwise: SFT would train on other ids
    records = datasets.Dataset.from_list([{"question": question, "answer": answer},
                                          {"question": "What is 2+3?", "answer": "#### 5"}])
    rows = tokenize_pairs(records, tok, 64, DataStats(), pieces=pieces)
    assert rows["observed"] == [[len(p) + i for i in observed], []] and rows["ids"][0] == p + a
    batch = sft_batch(rows[:], pad_id=tok.pad_id)
    trained = (batch["targets"][0] != IGNORE).nonzero().flatten().tolist()
    # the targets: the answer's own tokens (the target at t is x_{t+1}), never an observation's
    assert trained == [len(p) - 1 + i for i in range(len(a)) if i not in observed]
    packed = PackedPairs(rows[:], 2 * len(p + a), tok.pad_id, reset=True, seed=0, shuffle=False).batch([0])
    assert sorted(packed["targets"][0][packed["targets"][0] != IGNORE].tolist()) == sorted(
        batch["targets"][batch["targets"] != IGNORE].tolist())


def test_sft_env_names_an_environment_that_finds_its_observations():
    from rlt_mega.config import ConfigError
    from rlt_mega.train.sft import episode_pieces

    assert episode_pieces(None) is None
    assert episode_pieces("calculator")("<<1+1=2>>") == [("<<1+1=", False), ("2>>", True)]
    with pytest.raises(ConfigError, match="sft.env='chat': Chat does not find its observations"):
        episode_pieces("chat")
    with pytest.raises(ConfigError, match="sft.env"):
        episode_pieces("no_such_env")
