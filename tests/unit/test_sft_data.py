"""SFT's batches: the loss on answer tokens only, and the record order that resumes and reshuffles."""

import pytest

from rlt_mega.data.pairs import RecordOrder, answer_ids, prompt_ids
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
