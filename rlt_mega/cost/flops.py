"""FLOPs of one training step, counted as matmul multiply-adds x 2 (the convention of
``torch.utils.flop_counter``). Norms, RoPE, softmax, SiLU, residual adds, the embedding
gather and the loss are elementwise and left out (a few per cent of a step at most).

Per sequence of T positions (B = 1), summed over all L layers:

  encoder, per layer    q/k/v/o projections 2d(2q + 2kv) per position; MLP 6dF per position;
                        causal scores QK^T and PV: 4 H Dh x pairs, pairs = T(T+1)/2 for a
                        kernel that skips masked tiles ("flash"), T^2 for the plain
                        matmul composition ("math", what flop_counter sees on CPU)
  decoder, per layer    the same q/k/v/o and MLP per position (shared weights); cross q and o
                        4 d q per position; the memory K/V projections 4 d kv x (T + 1) rows
                        (the null slot is projected for every sequence); self-attention scores
                        4 H Dh (t + 1) at position t; cross scores 4 H Dh (1 + vis(t))
  decoder input         recur_proj 2 d^2 per position
  head                  lm_head 2 d V per position (recomputed in the backward under
                        train.checkpointing.head_chunk: each chunk's logits)

model.arch dense / looped (model/baselines.py): the encoder rows alone, for R * L block
applications (R = model.loops; 1 for dense), every one a causal batch, and the head; no
decoder. Activation checkpointing (train.checkpointing.encoder, or any decoder mode) recomputes
each block application, less its final down projection (the early stop).

Backward: linear layers 2x forward (input and weight gradients). Scores: "math" 2x; "flash"
2.5x (the kernel recomputes QK^T, as flop_counter counts it); the decoder self-attention's
own autograd Function 3x (it recomputes the probabilities, then four matmuls). Recomputation
under activation checkpointing repeats the forward of what is checkpointed: the whole decoder
recurrence except the memory K/V projections (they run once, outside the segments: the decoder
step recomputes each segment of k positions in full, model/decoder.py), and/or the encoder
blocks. torch's non-reentrant checkpoint stops recomputing once the last tensor saved for
backward is back ("early stop"), so the final MLP down projection of each encoder block is not
recomputed.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from rlt_mega.config import CheckpointingConfig, ModelConfig
from rlt_mega.model.rlt import vis


@dataclass
class FlopRow:
    part: str  # encoder | decoder | head
    component: str
    forward: float
    backward: float
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


@functools.lru_cache(maxsize=None)
def attention_pairs(T: int, C: int) -> dict[str, int]:
    """Query-key pairs per sequence: encoder causal (half and full square), decoder self
    (sum over t of t + 1) and cross (sum over t of 1 + vis(t))."""
    return {"causal": T * (T + 1) // 2, "square": T * T, "decoder_self": T * (T + 1) // 2,
            "cross": sum(1 + vis(t, C) for t in range(T))}


def flop_rows(cfg: ModelConfig, seq_len: int, checkpointing: CheckpointingConfig | None = None,
              kernel: str = "flash", layers: int | None = None, tp: int = 1,
              first_stage: bool = True, last_stage: bool = True) -> list[FlopRow]:
    """FLOPs of one sequence (B = 1) on one rank that holds ``layers`` layers (default all)
    with tensor-parallel size ``tp``; ``first_stage``/``last_stage`` add the recurrence input
    and the head. Every sharded matmul divides by tp; recur_proj is replicated."""
    ck = checkpointing or CheckpointingConfig()
    if cfg.arch != "rlt":
        return _baseline_rows(cfg, seq_len, ck, kernel, tp)
    T, d, L = seq_len, cfg.d_model, cfg.n_layers if layers is None else layers
    q, kv, f = cfg.n_heads * cfg.head_dim / tp, cfg.n_kv_heads * cfg.head_dim / tp, cfg.ffn_hidden / tp
    hd = q  # H * Dh on this rank: what the score matmuls scale with
    pairs = attention_pairs(T, cfg.memory_block)
    enc_pairs = pairs["causal"] if kernel == "flash" else pairs["square"]
    sdpa_bwd = 2.5 if kernel == "flash" else 2.0
    dec_ck, enc_ck = ck.decoder != "none", bool(ck.encoder)
    down = 2 * d * f  # one position's MLP down projection, skipped by the early stop

    proj = L * T * 2 * d * (2 * q + 2 * kv)
    mlp = L * T * 6 * d * f
    enc_scores = L * 4 * hd * enc_pairs
    rows = [
        FlopRow("encoder", "self_attn_proj", proj, 2 * proj, proj if enc_ck else 0),
        FlopRow("encoder", "self_attn_scores", enc_scores, sdpa_bwd * enc_scores, enc_scores if enc_ck else 0),
        FlopRow("encoder", "mlp", mlp, 2 * mlp, mlp - L * T * down if enc_ck else 0),
    ]
    dec_self = L * 4 * hd * pairs["decoder_self"]
    cross_proj = L * T * 4 * d * q
    cross_scores = L * 4 * hd * pairs["cross"]
    memory_kv = L * (T + 1) * 4 * d * kv
    recur = T * 2 * d * d if first_stage else 0
    rows += [
        FlopRow("decoder", "self_attn_proj", proj, 2 * proj, proj if dec_ck else 0),
        FlopRow("decoder", "self_attn_scores", dec_self, 3 * dec_self, dec_self if dec_ck else 0),
        FlopRow("decoder", "cross_attn_proj", cross_proj, 2 * cross_proj, cross_proj if dec_ck else 0),
        FlopRow("decoder", "cross_attn_scores", cross_scores, sdpa_bwd * cross_scores,
                cross_scores if dec_ck else 0),
        FlopRow("decoder", "memory_kv_proj", memory_kv, 2 * memory_kv, 0),
        FlopRow("decoder", "mlp", mlp, 2 * mlp, mlp if dec_ck else 0),
        FlopRow("decoder", "recurrence", recur, 2 * recur, recur if dec_ck else 0),
    ]
    head = T * 2 * d * cfg.vocab_size / tp if last_stage else 0
    rows.append(FlopRow("head", "lm_head", head, 2 * head, head if ck.head_chunk else 0))
    return rows


def _baseline_rows(cfg: ModelConfig, T: int, ck: CheckpointingConfig, kernel: str, tp: int) -> list[FlopRow]:
    """The dense and looped models: R * L causal block applications and the head."""
    d, n = cfg.d_model, cfg.loops * cfg.n_layers
    q, kv, f = cfg.n_heads * cfg.head_dim / tp, cfg.n_kv_heads * cfg.head_dim / tp, cfg.ffn_hidden / tp
    pairs = attention_pairs(T, 1)["causal" if kernel == "flash" else "square"]
    sdpa_bwd = 2.5 if kernel == "flash" else 2.0
    ckpt = bool(ck.encoder) or ck.decoder != "none"
    proj = n * T * 2 * d * (2 * q + 2 * kv)
    mlp = n * T * 6 * d * f
    scores = n * 4 * q * pairs
    head = T * 2 * d * cfg.vocab_size / tp
    return [
        FlopRow("encoder", "self_attn_proj", proj, 2 * proj, proj if ckpt else 0),
        FlopRow("encoder", "self_attn_scores", scores, sdpa_bwd * scores, scores if ckpt else 0),
        FlopRow("encoder", "mlp", mlp, 2 * mlp, mlp - n * T * 2 * d * f if ckpt else 0),
        FlopRow("head", "lm_head", head, 2 * head, head if ck.head_chunk else 0),
    ]


def sdpa_rows(rows: list[FlopRow]) -> list[FlopRow]:
    """The rows computed by scaled_dot_product_attention (encoder and cross scores)."""
    return [r for r in rows if r.component in ("self_attn_scores", "cross_attn_scores") and
            not (r.part == "decoder" and r.component == "self_attn_scores")]


def summarize(rows: list[FlopRow], seq_len: int) -> dict:
    """Totals per sequence, per token, and by part, in a JSON-friendly dict."""
    def total(rs, key):
        return sum(getattr(r, key) for r in rs)
    out = {"rows": [asdict(r) | {"total": r.total} for r in rows]}
    for part in ("encoder", "decoder", "head"):
        rs = [r for r in rows if r.part == part]
        out[part] = {k: total(rs, k) for k in ("forward", "backward", "recompute")}
    out["forward"] = total(rows, "forward")
    out["backward"] = total(rows, "backward")
    out["recompute"] = total(rows, "recompute")
    # "model" FLOPs exclude recomputation (the MFU convention); "hardware" FLOPs include it.
    out["model"] = out["forward"] + out["backward"]
    out["hardware"] = out["model"] + out["recompute"]
    out["per_token"] = {k: out[k] / seq_len for k in ("forward", "backward", "recompute", "model", "hardware")}
    out["per_token_by_part"] = {p: sum(out[p].values()) / seq_len for p in ("encoder", "decoder", "head")}
    return out
