"""A naive re-implementation of the RLT forward (docs/design.md, "The model") that shares nothing with
rlt_mega.model except the parameters: explicit softmax attention, K/V kept in Python lists
and concatenated per step. The tests compare the model to it, and switch off BPTT paths in it
(which the model itself never does) to show that each path carries gradient.
"""

import math

import torch


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    # x: (h, Dh) at one position
    Dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    ang = pos * inv
    cos = torch.cat([ang.cos(), ang.cos()]).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()]).to(x.dtype)
    half = Dh // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _attn(q, ks, vs, n_heads, n_kv):
    # q: (h, Dh); ks, vs: (S, h_kv, Dh)
    g = n_heads // n_kv
    out = []
    for h in range(n_heads):
        kh, vh = ks[:, h // g], vs[:, h // g]
        w = torch.softmax((kh @ q[h]) / math.sqrt(q.shape[-1]), dim=0)
        out.append(w @ vh)
    return torch.stack(out)


def reference_logits(model, tokens, detach_recurrence=False, detach_decoder_kv=False, detach_memory=False):
    cfg = model.cfg
    B, T = tokens.shape
    H, Hkv, Dh, C, eps, th = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.memory_block, cfg.norm_eps, cfg.rope_theta
    lin = lambda mod, x: x @ mod.weight.T + (mod.bias if mod.bias is not None else 0)
    logits = []
    for b in range(B):
        x = tokens[b]
        # encoder, position by position with explicit causal attention
        h = [model.embed.weight[x[t]] for t in range(T)]
        for i, blk in enumerate(model.blocks):
            a_in = [_rms(v, blk.attn_norm.weight, eps) for v in h]
            q = [_rope(lin(blk.attn.q, v).view(H, Dh), t, th) for t, v in enumerate(a_in)]
            k = [_rope(lin(blk.attn.k, v).view(Hkv, Dh), t, th) for t, v in enumerate(a_in)]
            vv = [lin(blk.attn.v, v).view(Hkv, Dh) for v in a_in]
            new = []
            for t in range(T):
                a = _attn(q[t], torch.stack(k[: t + 1]), torch.stack(vv[: t + 1]), H, Hkv)
                hh = h[t] + lin(blk.attn.o, a.reshape(-1))
                mm = _rms(hh, blk.mlp_norm.weight, eps)
                hh = hh + lin(blk.mlp.down, torch.nn.functional.silu(lin(blk.mlp.gate, mm)) * lin(blk.mlp.up, mm))
                new.append(hh)
            h = new
        mem = [_rms(v, model.memory_norm.weight, eps) for v in h]
        if detach_memory:
            mem = [v.detach() for v in mem]
        z = model.z_init
        dk = [[] for _ in range(cfg.n_layers)]
        dv = [[] for _ in range(cfg.n_layers)]
        for t in range(T):
            zin = z.detach() if detach_recurrence else z
            u = model.embed.weight[x[t]] + lin(model.recur_proj, _rms(zin, model.recur_norm.weight, eps))
            visible = [model.null_memory] + mem[: C * ((t + 1) // C)]
            for i in range(cfg.n_layers):
                blk = model.decoder_block(i)
                a_in = _rms(u, blk.attn_norm.weight, eps)
                q = _rope(lin(blk.attn.q, a_in).view(H, Dh), t, th)
                kt = _rope(lin(blk.attn.k, a_in).view(Hkv, Dh), t, th)
                vt = lin(blk.attn.v, a_in).view(Hkv, Dh)
                prev_k = [kk.detach() if detach_decoder_kv else kk for kk in dk[i]]
                prev_v = [vv_.detach() if detach_decoder_kv else vv_ for vv_ in dv[i]]
                dk[i].append(kt)
                dv[i].append(vt)
                a = _attn(q, torch.stack(prev_k + [kt]), torch.stack(prev_v + [vt]), H, Hkv)
                u = u + lin(blk.attn.o, a.reshape(-1))
                cb = model.cross[i]
                c_in = _rms(u, cb.cross_norm.weight, eps)
                cq = lin(cb.attn.q, c_in).view(H, Dh)
                mk = torch.stack([lin(cb.attn.k, s).view(Hkv, Dh) for s in visible])
                mv = torch.stack([lin(cb.attn.v, s).view(Hkv, Dh) for s in visible])
                u = u + lin(cb.attn.o, _attn(cq, mk, mv, H, Hkv).reshape(-1))
                mm = _rms(u, blk.mlp_norm.weight, eps)
                u = u + lin(blk.mlp.down, torch.nn.functional.silu(lin(blk.mlp.gate, mm)) * lin(blk.mlp.up, mm))
            z = u
            logits.append(lin(model.lm_head, _rms(z, model.final_norm.weight, eps)))
    return torch.stack(logits).view(B, T, -1)
