"""Packed SFT and document resets (data.pack, data.reset_at_document; model/documents.py,
data/packing.py): a packed batch's loss and gradient equal those of the same pairs trained one
per row (fp32, 1e-5), with documents ending on and off memory-block boundaries; changing one
document moves no other document's logits; best-fit packing; pretraining's document starts."""

import pytest
import torch
import torch.nn.functional as F

from rlt_mega.config import CheckpointingConfig, ModelConfig
from rlt_mega.data.packing import PackedPairs, pack_rows, packed_batch
from rlt_mega.data.pretraining import window_batch
from rlt_mega.loss import IGNORE, LM_LOSS
from rlt_mega.model.documents import DOC_STARTS, Documents
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.batching import pad_batch
from tests.distributed.packing_scenarios import ROWS, pairs_case, unpacked_batch

V = 37


def tiny(C: int, **kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": V, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                          "ffn_hidden": 64, "memory_block": C, "max_seq_len": 32, **kw})


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict]:
    """The engines' normalisation: the summed token loss over the batch's target count."""
    model.zero_grad(set_to_none=True)
    logits = model(batch["inputs"], documents=Documents.of(batch))
    loss = F.cross_entropy(logits.reshape(-1, V), batch["targets"].reshape(-1), ignore_index=IGNORE,
                           reduction="sum") / LM_LOSS.count(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("C,kw", [(4, {}), (3, {"share_weights": False, "qkv_bias": True}), (1, {})])
def test_packed_loss_and_gradient_equal_the_pairs_one_per_row(C, kw):
    rows, length = pairs_case(V)
    ends = {sum(r[:i + 1]) % C for r in ROWS for i in range(len(r))}
    assert C == 1 or (0 in ends and len(ends) > 1)  # documents end on and off block boundaries
    model = build_model(tiny(C, **kw), seed=5)
    packed = packed_batch(rows, pad_id=0, length=length, reset=True)
    flat = unpacked_batch(rows)
    assert LM_LOSS.count(packed) == LM_LOSS.count(flat)
    loss, grads = loss_and_grads(model, packed)
    ref_loss, ref_grads = loss_and_grads(model, flat)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 1e-3  # not vacuous


def test_checkpointed_packed_gradients_equal_the_plain_ones():
    rows, length = pairs_case(V)
    packed = packed_batch(rows, pad_id=0, length=length, reset=True)
    model = build_model(tiny(4), seed=5)
    loss, grads = loss_and_grads(model, packed)
    model.set_checkpointing(CheckpointingConfig(encoder=True, decoder="every_k", decoder_k=3))
    loss2, grads2 = loss_and_grads(model, packed)
    assert torch.equal(loss, loss2)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_changing_one_document_moves_no_other_documents_logits():
    model = build_model(tiny(4), seed=2)
    lengths = [6, 5, 7, 3]  # one row; the third document is changed
    g = torch.Generator().manual_seed(1)
    row = torch.randint(0, V, (1, sum(lengths)), generator=g)
    starts = torch.zeros_like(row, dtype=torch.bool)
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
    starts[0, bounds[:-1]] = True
    changed = row.clone()
    a, b = bounds[2], bounds[3]
    changed[0, a:b] = (row[0, a:b] + 1 + torch.randint(0, V - 1, (b - a,), generator=g)) % V
    with torch.no_grad():
        before = model(row, Documents(starts))
        after = model(changed, Documents(starts))
        plain = model(row)  # without resets the change reaches every later position
        plain_changed = model(changed)
    keep = torch.ones(row.shape[1], dtype=torch.bool)
    keep[a:b] = False
    assert torch.equal(before[0, keep], after[0, keep])
    assert not torch.equal(before[0, a:b], after[0, a:b])
    assert not torch.allclose(plain[0, b:], plain_changed[0, b:])
    # each document's logits are those of the document alone in its row
    for s, e in zip(bounds[:-1], bounds[1:]):
        with torch.no_grad():
            alone = model(row[:, s:e])
        torch.testing.assert_close(before[:, s:e], alone, rtol=1e-5, atol=1e-5)


def test_document_structure_positions_and_masks():
    starts = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    docs = Documents(starts)
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    mem = docs.memory(2)[0]  # (T, 1 + T)
    # position 6 (document-local 3): vis = 4, slots of positions 3..6; position 5 (local 2): vis 2
    assert mem[6].tolist() == [True] + [False] * 3 + [True] * 4 + [False]
    assert mem[5].tolist() == [True] + [False] * 3 + [True] * 2 + [False] * 3
    assert mem[0].tolist() == [True] + [False] * 8  # a partial block is never visible
    assert docs.attend[0, 4].tolist() == [False] * 3 + [True] * 2 + [False] * 3
    from rlt_mega.model.layout import Step

    tables = tuple(torch.arange(16.0)[:, None].expand(16, 4) for _ in range(3))  # row p of each table holds p
    step = Step.documents(6, docs, tables, 2, 1, torch.float32, batch=1, slot=0, ring=0)
    assert step.n_self == 7 and step.n_mem == 8 and step.cos.flatten().tolist() == [3.0] * 4  # document-local 3
    assert torch.isinf(step.mem_mask[0, 0]).tolist() == [not v for v in mem[6, :8].tolist()]
    assert step.reset is not None and not bool(step.reset[0])


def test_best_fit_packing_places_every_pair_once_within_capacity():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 20, (300,), generator=g).tolist()
    order = torch.randperm(300, generator=g).tolist()
    rows = pack_rows(lengths, 24, order)
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(sum(lengths[i] for i in r) <= 24 for r in rows)
    assert sum(lengths) / (24 * len(rows)) > 0.9  # best fit fills the rows
    with pytest.raises(ValueError, match="cannot go into a row of 24"):
        pack_rows([25], 24, [0])


def test_packed_pairs_rows_hold_the_pairs_tokens_and_targets():
    rows, length = pairs_case(V)
    pairs = [p for r in rows for p in r]
    data = PackedPairs({"ids": [p[0] for p in pairs], "num_prompt": [p[1] for p in pairs]}, length, pad_id=0,
                       reset=True, seed=3)
    batch = data.batch(list(range(len(data))))
    assert batch["inputs"].shape == (len(data), length)
    assert int(batch[DOC_STARTS].sum()) == len(pairs)
    flat = unpacked_batch(rows)
    assert LM_LOSS.count(batch) == LM_LOSS.count(flat)
    assert sorted(batch["targets"][batch["targets"] != IGNORE].tolist()) == \
        sorted(flat["targets"][flat["targets"] != IGNORE].tolist())
    assert DOC_STARTS not in PackedPairs({"ids": [p[0] for p in pairs], "num_prompt": [p[1] for p in pairs]},
                                         length, 0, reset=False, seed=3).batch([0])


def test_padding_and_pipeline_pieces_keep_the_documents():
    rows, length = pairs_case(V)
    packed = packed_batch(rows, pad_id=0, length=length, reset=True)
    padded = pad_batch(packed, length + 3)
    assert padded[DOC_STARTS].shape == (3, length + 3) and not padded[DOC_STARTS][:, length:].any()
    model = build_model(tiny(4), seed=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded["inputs"], Documents.of(padded))[:, :length],
                                   model(packed["inputs"], Documents.of(packed)), rtol=1e-6, atol=1e-6)
    pieces = LM_LOSS.split(packed, 3)
    assert [p[DOC_STARTS].shape[0] for p in pieces] == [1, 1, 1]
    assert torch.equal(torch.cat([p[DOC_STARTS] for p in pieces]), packed[DOC_STARTS])


def test_pretraining_documents_start_at_each_end_of_text():
    eot = 0
    window = torch.tensor([[5, 6, eot, 7, 8, 9, eot, 4, 3]])
    batch = window_batch(window, doc_start_token=eot)
    assert batch[DOC_STARTS].tolist() == [[False, False, True, False, False, False, True, False]]
    assert Documents.of(batch).positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]
    assert DOC_STARTS not in window_batch(window)


def test_grpo_refuses_data_pack():
    from rlt_mega.config import ConfigError, from_dict
    from rlt_mega.train.grpo import grpo_config

    with pytest.raises(ConfigError, match="data.pack=true packs SFT pairs"):
        grpo_config(from_dict({"data": {"pack": True}}))
