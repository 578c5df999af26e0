"""The encoder's causal self-attention (one batch, or chunk by chunk after a cached prefix).
The decoder's two attentions (over its own K/V and into the memory) are the decoder step's
(model/kernels.py ``attend``, model/decoder.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F



def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of queries at positions [start, start + n) to keys [0, start + n).

    q: (B, h, n, Dh); k, v: (B, h_kv, start + n, Dh) -> (B, h, n, Dh). ``mask`` (B, n, start + n)
    bool, packed documents (model/documents.py): query i sees key j where True (causal within
    its document).
    """
    n, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    if start == 0 and S == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # A chunk after a cached prefix: query i (position start + i) sees keys j <= start + i.
    q_pos = torch.arange(start, start + n, device=q.device)
    k_pos = torch.arange(S, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
