"""The cost of one training step of an RLT configuration: parameters by group (whole model
and per rank), FLOPs per token split into encoder, decoder and head (forward, backward,
recomputation), memory per rank by phase, the pipeline bubble, and communication per group.

``estimate(model_cfg, layout)`` returns a JSON-friendly dict; ``format_report`` renders it for
people. Pure functions of the configs: nothing is allocated. The assumptions behind each
number are in the docstrings of ``flops``, ``memory``, ``comm`` and ``params``.
"""

from __future__ import annotations

import dataclasses

from rlt_mega.config import ModelConfig
from rlt_mega.cost.comm import bubble_fraction, comm_per_step, encoder_bubble_fraction, ring_ticks
from rlt_mega.cost.flops import flop_rows, summarize
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.memory import estimate_memory
from rlt_mega.parallel.dims import check_tp
from rlt_mega.cost.params import adapter_param_count, model_param_counts, rank_param_counts, stage_layers


def stage_flops(cfg: ModelConfig, layout: Layout, stage: int) -> dict:
    """FLOPs of one rank of ``stage`` for one sequence (see ``flops.flop_rows``)."""
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    rows = flop_rows(cfg, layout.seq_len, layout.checkpointing, layout.attention_kernel, layers=n,
                     tp=layout.tp, first_stage=stage == 0, last_stage=stage == layout.pp - 1)
    return summarize(rows, layout.seq_len)


def estimate(cfg: ModelConfig, layout: Layout) -> dict:
    """Everything the cost model knows about one step of ``cfg`` under ``layout``."""
    check_tp(cfg, layout.tp)
    stages = range(layout.pp)
    stage_layers(cfg.n_layers, layout.pp, layout.pp_split)  # validates the split
    whole = summarize(flop_rows(cfg, layout.seq_len, layout.checkpointing, layout.attention_kernel),
                      layout.seq_len)
    seqs_per_rank = layout.micro_batch_size * layout.micro_batches * layout.grad_accum
    per_rank = []
    for s in stages:
        f = stage_flops(cfg, layout, s)
        mem = estimate_memory(cfg, layout, s)
        per_rank.append({
            "stage": s,
            "layers": list(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[s]),
            "params": rank_param_counts(cfg, layout.tp, layout.pp, s, layout.pp_split),
            "flops_per_step": {k: f[k] * seqs_per_rank for k in ("forward", "backward", "recompute",
                                                                  "model", "hardware")},
            "memory": _memory_dict(mem),
            "comm": comm_per_step(cfg, layout, s),
        })
    worst = max(per_rank, key=lambda r: r["memory"]["peak"])
    return {
        "model": dataclasses.asdict(cfg),
        "layout": _layout_dict(layout),
        "params": {**model_param_counts(cfg), **({"adapters": adapter_param_count(cfg)} if cfg.lora.enabled else {})},
        "flops": {
            # per position, averaged over the sequence (attention grows with the position)
            "per_token": {part: {k: v / layout.seq_len for k, v in whole[part].items()}
                          for part in ("encoder", "decoder", "head")},
            "per_token_total": whole["per_token"],
            "rows_per_sequence": whole["rows"],
            "per_step_global": {k: whole[k] * layout.sequences_per_step for k in ("model", "hardware")},
        },
        "pipeline": {
            "decoder_bubble": bubble_fraction(layout.seq_len, layout.micro_batches, layout.pp),
            "encoder_bubble": encoder_bubble_fraction(layout.micro_batches, layout.pp),
            "ring_ticks": ring_ticks(layout.seq_len, layout.micro_batches, layout.pp),
        },
        "per_rank": per_rank,
        "peak_memory": worst["memory"]["peak"],
        "peak_stage": worst["stage"],
    }


def _memory_dict(mem) -> dict:
    out = {k: getattr(mem, k) for k in ("weights", "gradients", "master_weights", "optimizer_states",
                                        "zero_buffers", "rope_tables", "optimizer_state_numel",
                                        "master_numel")}
    out |= {"activations": mem.activations, "phases": mem.phases, "rollout": mem.rollout,
            "peak": mem.peak, "peak_phase": mem.peak_phase}
    return out


def _layout_dict(layout: Layout) -> dict:
    out = dataclasses.asdict(layout)
    out["world_size"] = layout.world_size
    out["sequences_per_step"] = layout.sequences_per_step
    out["tokens_per_step"] = layout.tokens_per_step
    return out


# ------------------------------------------------------------------ rendering
def _si(x: float, unit: str = "") -> str:
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _gib(x: float) -> str:
    return f"{x / 2 ** 30:.2f} GiB" if x >= 2 ** 28 else f"{x / 2 ** 20:.2f} MiB"


def format_report(rep: dict) -> str:
    """A plain-text table of ``estimate``'s result."""
    m, lay = rep["model"], rep["layout"]
    T = lay["seq_len"]
    arch = m.get("arch", "rlt")
    family = {"rlt": f"RLT C={m['memory_block']}", "dense": "dense (Llama layout)",
              "looped": f"looped R={m.get('loops', 1)} (blocks applied R times; FLOP rows 'encoder' = the blocks)"}[arch]
    lines = [
        f"{family}: d={m['d_model']} L={m['n_layers']} H={m['n_heads']} H_kv={m['n_kv_heads']} "
        f"ffn={m['ffn_hidden']} V={m['vocab_size']} "
        f"(share_weights={m['share_weights']}, tied={m['tie_embeddings']})",
        f"layout tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} (world {lay['world_size']}), "
        f"ZeRO-{lay['zero_stage']}, {lay['dtype']}, T={T}, micro-batch {lay['micro_batch_size']} x "
        f"{lay['micro_batches']} in flight x {lay['grad_accum']} accumulation; "
        f"{lay['sequences_per_step']} sequences = {_si(lay['tokens_per_step'])} tokens per step",
        f"checkpointing: decoder={lay['checkpointing']['decoder']}"
        + (f" (k={lay['checkpointing']['decoder_k']})" if lay['checkpointing']['decoder'] == "every_k" else "")
        + f", encoder={lay['checkpointing']['encoder']}"
        + (f", head_chunk={lay['checkpointing']['head_chunk']}" if lay['checkpointing'].get('head_chunk') else "")
        + f"; attention kernel {lay['attention_kernel']}",
        "",
        "Parameters",
    ]
    for k, v in rep["params"].items():
        lines.append(f"  {k:<16}{v:>16,}")
    lines += ["", f"FLOPs per token (sequence of {T}; fwd / bwd / recompute)"]
    for row in rep["flops"]["rows_per_sequence"]:
        lines.append(f"  {row['part']:<8}{row['component']:<20}{_si(row['forward'] / T):>12}"
                     f"{_si(row['backward'] / T):>12}{_si(row['recompute'] / T):>12}")
    pt = rep["flops"]["per_token_total"]
    lines.append(f"  {'total':<28}{_si(pt['forward']):>12}{_si(pt['backward']):>12}{_si(pt['recompute']):>12}"
                 f"   model {_si(pt['model'])}, hardware {_si(pt['hardware'])}")
    by = {p: sum(rep["flops"]["per_token"][p].values()) for p in ("encoder", "decoder", "head")}
    lines.append("  share: " + ", ".join(f"{p} {by[p] / sum(by.values()):.0%}" for p in by))
    pipe = rep["pipeline"]
    lines += ["", f"Pipeline: decoder ring bubble {pipe['decoder_bubble']:.2%} ({pipe['ring_ticks']:,} ticks), "
                  f"encoder bubble {pipe['encoder_bubble']:.2%}", "",
              "Per rank (one rank of each pipeline stage)"]
    for r in rep["per_rank"]:
        mem = r["memory"]
        lines.append(f"  stage {r['stage']} (layers {r['layers'][0]}..{r['layers'][-1]}): "
                     f"{r['params']['total']:,} params, "
                     f"{_si(r['flops_per_step']['hardware'], 'FLOP')} per step")
        lines.append(f"    weights {_gib(mem['weights'])}, master {_gib(mem['master_weights'])}, "
                     f"Adam {_gib(mem['optimizer_states'])}, grads after bwd {_gib(mem['gradients'])}, "
                     f"ZeRO buffers {_gib(mem['zero_buffers'])}")
        acts = ", ".join(f"{k} {_gib(v)}" for k, v in mem["activations"].items() if v)
        lines.append(f"    activations per micro-batch: {acts}")
        phases = ", ".join(f"{k} {_gib(v)}" for k, v in mem["phases"].items())
        lines.append(f"    peak {_gib(mem['peak'])} in {mem['peak_phase']} ({phases})")
        ro = mem["rollout"]
        lines.append(f"    rollout K/V caches ({ro['batch']} x {ro['positions']} positions): "
                     f"{_gib(ro['kv_caches'])}; with the resident training state {_gib(ro['total'])}")
        comm = ", ".join(f"{g} {_gib(c['bytes'])} in {c['messages']:,} messages"
                         for g, c in r["comm"].items() if c["group_size"] > 1) or "none"
        lines.append(f"    communication per step: {comm}")
    lines.append(f"\nPeak memory per rank: {_gib(rep['peak_memory'])} (stage {rep['peak_stage']})")
    return "\n".join(lines)
