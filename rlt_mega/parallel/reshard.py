"""The layout-free training state: how a checkpoint resumes on any layout, with its optimizer state.

Every training checkpoint carries, beside DeepSpeed's per-rank files (or the single-process
``model.safetensors`` + ``engine.pt``), its optimizer state **free of the layout**: for every
trained parameter, under its name, the fp32 master, Adam's ``exp_avg`` and ``exp_avg_sq``, as
full tensors cut only by the tensor-parallel plan the export already uses (TP_TABLE,
:func:`shard_dim`), plus the Adam step and the schedule position::

    state/mp{mp:03d}_dp{dp:03d}_{k:03d}.safetensors
        "<name>::fp32", "<name>::exp_avg", "<name>::exp_avg_sq"   this writer's TP slice of <name>
        metadata: format, tp, tp_rank, adam_step, steps_taken

A writing rank holds its stage's TP slice of a parameter complete over the data-parallel group
(DeepSpeed's ``safe_get_full_*`` accessors gather a ZeRO partition, one parameter at a time);
the parameters of a stage are dealt round-robin over the data-parallel ranks, so every rank
writes about 1/dp of them, in files of at most one bucket. A replicated parameter (a norm, a
row-parallel bias) is written by tensor-parallel rank 0 only; a pipeline replica (``null_memory``
on later stages, a tied ``lm_head``) is not written: it is the first stage's copy.

Resuming (parallel/ds_checkpoint.py, parallel/engine.py): on the layout the checkpoint was
written with, the engine's own files load as before (bit for bit); on any other layout -- tp,
pp or its split, dp, the ZeRO stage, one process or many -- each rank reads from ``state/`` the
slice of each of its parameters that its new TP rank needs (safetensors reads a slice without
the rest of the tensor) and hands it to the optimizer it now runs (ds_state.py). One mechanism
for every change; docs/design.md says why this one. ``rlt-mega reshard`` writes the same state
cut for another layout, offline (checkpoint_tools/reshard_ckpt.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.config import ModelConfig
from rlt_mega.log import get_logger
from rlt_mega.parallel.tp import param_shard_dim, tp_kind

log = get_logger(__name__)

STATE_DIR = "state"
FORMAT = "rlt-layout-free/1"
KEYS = ("fp32", "exp_avg", "exp_avg_sq")
SEP = "::"
BUCKET_BYTES = 256 << 20  # one state file holds at most this much (one larger parameter excepted)
_LORA = re.compile(r"^(?P<module>.+)\.parametrizations\.weight\.\d+\.(?P<leaf>lora_[AB])$")


# ------------------------------------------------------------------------------------------
# The TP plan of a parameter name
# ------------------------------------------------------------------------------------------

def shard_dim(name: str) -> Optional[int]:
    """The dimension along which parameter ``name`` is cut over the tensor-parallel ranks (None:
    replicated): TP_TABLE for the model's parameters; for an adapter (model.lora) of a column
    layer its B (output rows), of a row layer its A (input columns)."""
    m = _LORA.match(name)
    if m is None:
        return param_shard_dim(name)
    kind = tp_kind(m.group("module"))
    if kind in ("column", "vocab_head"):
        return 0 if m.group("leaf") == "lora_B" else None
    if kind == "row":
        return 1 if m.group("leaf") == "lora_A" else None
    return None


def bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of ``parts`` pieces of ``length`` as torch.chunk cuts them (the
    cut tensor parallelism makes, parallel/tp.py)."""
    size = math.ceil(length / parts)
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(parts)]


# ------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------

def saved_layout(directory: Path) -> Optional[dict]:
    """The layout in a checkpoint's manifest.json (None without one: a bare engine save)."""
    manifest = Path(directory) / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text()).get("layout")
    except (json.JSONDecodeError, AttributeError):
        raise CheckpointError(f"checkpoint {directory}: manifest.json is corrupt") from None


def format_layout(layout: dict) -> str:
    keys = ("tp", "pp", "dp", "zero_stage") + (("pp_split",) if layout.get("pp_split") else ())
    return "{" + ", ".join(f"{k}={layout.get(k)}" for k in keys) + "}"


def same_layout(a: dict, b: dict) -> bool:
    """Whether two layouts hold the same files: tp, pp, dp, the ZeRO stage and (where both
    record it) the stage split."""
    if any(a.get(k, d) != b.get(k, d) for k, d in (("tp", 1), ("pp", 1), ("dp", 1), ("zero_stage", 0))):
        return False
    sa, sb = a.get("pp_split"), b.get("pp_split")
    return sa is None or sb is None or list(sa) == list(sb)


def changes(saved: dict, current: dict) -> str:
    """What differs between two layouts, in words ("tp 2->4, zero_stage 1->3")."""
    keys = (("tp", 1), ("pp", 1), ("pp_split", None), ("dp", 1), ("zero_stage", 0))
    out = [f"{k} {saved.get(k, d)}->{current.get(k, d)}" for k, d in keys
           if saved.get(k, d) != current.get(k, d) and not (k == "pp_split" and None in (saved.get(k), current.get(k)))]
    return ", ".join(out) or "none"


def resumable_on(layout: dict, own_files: bool = True) -> str:
    """In words, the layouts on which a checkpoint of ``layout`` resumes (all of them);
    ``own_files``: it holds its engine's files (a reshard output holds the state only)."""
    if not own_files:
        return ("with its optimizer state on any layout, from its layout-free state (state/: it holds no engine "
                f"files, as a reshard output; cut for {format_layout(layout)})")
    return (f"with its optimizer state on any layout: on {format_layout(layout)} from its own files, on any other "
            "(tp, pp, stage split, dp, ZeRO stage, one process) from its layout-free state (state/)")


# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------

class StateWriter:
    """One rank's part of the layout-free state: tensors collected into files of at most one
    bucket (``bucket_bytes``), each written whole (safetensors) as it fills."""

    def __init__(self, directory: Path, mp: int, dp_rank: int, tp: int, tp_rank: int, meta: dict,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.dir = Path(directory) / STATE_DIR
        self.prefix = f"mp{mp:03d}_dp{dp_rank:03d}"
        self.meta = state_metadata(tp, tp_rank, meta)
        self.bucket_bytes, self.pending, self.bytes, self.count = bucket_bytes, {}, 0, 0

    def add(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        values = {f"{name}{SEP}{key}": tensors[key].detach().to("cpu", torch.float32).contiguous() for key in KEYS}
        size = sum(t.numel() * 4 for t in values.values())
        if self.pending and self.bytes + size > self.bucket_bytes:
            self.flush()  # a file never holds more than one bucket (or one larger parameter)
        self.pending.update(values)
        self.bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        write_safetensors(self.dir / f"{self.prefix}_{self.count:03d}.safetensors", self.pending, self.meta)
        self.pending, self.bytes, self.count = {}, 0, self.count + 1

    def close(self) -> None:
        self.flush()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory (safetensors'
    save_file first copies every tensor into one buffer: twice the bucket in memory)."""
    write_streamed(path, [(k, tuple(t.shape)) for k, t in tensors.items()], metadata, tensors.__getitem__)


def write_streamed(path: Path, entries: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str],
                   produce) -> None:
    """A safetensors file of fp32 tensors ``entries`` (key, shape), the header first, then each
    tensor's bytes as ``produce(key)`` returns it: one tensor in memory at a time. The format: an
    8-byte little-endian header size, the JSON header (padded to 8 bytes), the data."""
    header, offset = {"__metadata__": metadata}, 0
    for key, shape in entries:
        n = 4 * math.prod(shape)
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for key, shape in entries:
            t = produce(key).to("cpu", torch.float32).contiguous()
            if tuple(t.shape) != tuple(shape):  # the callers' plan, not a user error
                raise RuntimeError(f"{path}: '{key}' is {tuple(t.shape)}, planned {tuple(shape)}")
            f.write(memoryview(t.numpy()).cast("B"))


def state_metadata(tp: int, tp_rank: int, meta: dict) -> dict[str, str]:
    """The metadata of every file of the layout-free state."""
    return {"format": FORMAT, "tp": str(tp), "tp_rank": str(tp_rank), **{k: str(v) for k, v in meta.items()}}


def owner(index: int, name: str, tp_rank: int, dp_rank: int, dp: int) -> bool:
    """Whether this rank writes parameter number ``index`` of its stage: dealt round-robin over
    the data-parallel ranks; a TP-replicated parameter by tensor-parallel rank 0 only."""
    return index % dp == dp_rank and (shard_dim(name) is not None or tp_rank == 0)


# ------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------

@dataclass
class _Piece:
    file: Path
    tp_rank: int
    shape: tuple[int, ...]


@dataclass
class LayoutFreeState:
    """The index of a checkpoint's ``state/`` (file headers only): per parameter, which file
    holds which TP slice. :meth:`read` returns the slice a rank of any layout needs."""

    directory: Path
    tp: int
    adam_step: int
    steps_taken: int
    pieces: dict[str, list[_Piece]] = field(default_factory=dict)
    bytes_read: int = 0

    @classmethod
    def open(cls, checkpoint: Path) -> "LayoutFreeState":
        from safetensors import safe_open

        root = Path(checkpoint) / STATE_DIR
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        if not files:
            raise CheckpointError(f"checkpoint {checkpoint} has no layout-free state ({STATE_DIR}/): it was written "
                                  "with checkpoint.layout_free=false or before rlt_mega saved one, and resumes only "
                                  "on its own layout "
                                  f"{format_layout(saved_layout(checkpoint) or {})}; resume it there and save once "
                                  "to move it, or export it (rlt-mega export) and start from the weights "
                                  "(train.init_from)")
        metas, pieces = set(), {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    meta = h.metadata() or {}
                    shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
            except Exception as exc:  # SafetensorError, OSError: a damaged header
                raise CheckpointError(f"checkpoint file {f} cannot be read as safetensors ({exc})") from None
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint file {f}: not a layout-free state file (format "
                                      f"{meta.get('format')!r}, expected {FORMAT!r})")
            metas.add((int(meta["tp"]), int(meta["adam_step"]), int(meta["steps_taken"])))
            for key, shape in shapes.items():
                name, _, kind = key.rpartition(SEP)
                if kind == "fp32":
                    pieces.setdefault(name, []).append(_Piece(f, int(meta["tp_rank"]), shape))
        if len(metas) != 1:
            raise CheckpointError(f"checkpoint {checkpoint}: the files of {STATE_DIR}/ disagree on tp, step or "
                                  f"schedule position ({sorted(metas)}): files of two saves mixed?")
        tp, adam_step, steps_taken = metas.pop()
        state = cls(Path(checkpoint), tp, adam_step, steps_taken, pieces)
        for name, got in pieces.items():
            got.sort(key=lambda p: p.tp_rank)
            want = list(range(tp)) if shard_dim(name) is not None else [0]
            if [p.tp_rank for p in got] != want:
                raise CheckpointError(f"checkpoint {checkpoint}: {STATE_DIR}/ holds tensor-parallel slices "
                                      f"{[p.tp_rank for p in got]} of '{name}', expected {want}: a state file is "
                                      "missing")
        return state

    def names(self) -> list[str]:
        return sorted(self.pieces)

    def full_shape(self, name: str) -> tuple[int, ...]:
        got, dim = self.pieces[name], shard_dim(name)
        shape = list(got[0].shape)
        if dim is not None:
            shape[dim] = sum(p.shape[dim] for p in got)
        return tuple(shape)

    def lookup(self, name: str, tied: bool) -> str:
        """The stored name a parameter reads: itself, or for a tied lm_head the embedding."""
        if name not in self.pieces and tied and name == "lm_head.weight":
            name = "embed.weight"
        if name not in self.pieces:
            raise CheckpointError(f"checkpoint {self.directory}: its layout-free state has no '{name}' (this run "
                                  "trains another set of parameters: model.lora or the model differ?)")
        return name

    def slice_shape(self, name: str, tp: int, tp_rank: int) -> tuple[int, ...]:
        """The shape of tensor-parallel rank ``tp_rank`` of ``tp``'s slice of ``name``."""
        shape, dim = list(self.full_shape(name)), shard_dim(name)
        if dim is not None:
            start, stop = bounds(shape[dim], tp)[tp_rank]
            shape[dim] = stop - start
        return tuple(shape)

    def read(self, name: str, key: str, tp: int, tp_rank: int, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Tensor-parallel rank ``tp_rank`` of ``tp``'s slice of ``key`` of ``name`` (``rows``: only
        rows [a, b) of the slice's first dimension): read from the pieces it overlaps, no more."""
        from safetensors import safe_open

        got, dim, full = self.pieces[name], shard_dim(name), self.full_shape(name)
        want = [(0, n) for n in full]  # [start, stop) per dimension of the full tensor
        if dim is not None:
            want[dim] = bounds(full[dim], tp)[tp_rank]
        if rows is not None and full:  # within the slice
            start, stop = want[0]
            want[0] = (min(start + rows[0], stop), min(start + rows[1], stop))
        parts, offset = [], 0
        for piece in got if dim is not None else got[:1]:
            lo, hi = (offset, offset + piece.shape[dim]) if dim is not None else (0, 0)
            offset = hi
            index = []
            for d, (a, b) in enumerate(want):
                if d == dim:
                    a, b = max(lo, a) - lo, min(hi, b) - lo
                index.append(slice(a, max(a, b)))
            if dim is not None and index[dim].start >= index[dim].stop:
                continue
            with safe_open(str(piece.file), framework="pt") as h:
                sl = h.get_slice(f"{name}{SEP}{key}")
                parts.append(sl[tuple(index)] if full else h.get_tensor(f"{name}{SEP}{key}"))
        if not parts:  # an empty row range
            return torch.zeros([b - a for a, b in want])
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        self.bytes_read += out.numel() * 4
        return out


# ------------------------------------------------------------------------------------------
# Flat per-rank copies of parameters (GRPO's kept policy versions) on another layout
# ------------------------------------------------------------------------------------------

def flat_entries(cfg: ModelConfig, tp: int, pp: int, pp_split) -> list[list[list[tuple[str, tuple[int, ...], int]]]]:
    """Per pipeline stage and tensor-parallel rank of a layout, (name, shape of its TP slice,
    offset) of each parameter in a flat copy of that rank's module (its parameters in order)."""
    out = []
    for stage in _stage_params(cfg, pp, pp_split):
        ranks = []
        for tp_rank in range(tp):
            entries, offset = [], 0
            for name, shape in stage:
                cut = list(shape)
                dim = shard_dim(name)
                if dim is not None:
                    a, b = bounds(shape[dim], tp)[tp_rank]
                    cut[dim] = b - a
                entries.append((name, tuple(cut), offset))
                offset += math.prod(cut)
            ranks.append(entries)
        out.append(ranks)
    return out


def recut_flat(cfg: ModelConfig, saved: dict, flats: dict[tuple[int, int], torch.Tensor],
               named: Iterable[tuple[str, tuple[int, ...]]], tp: int, tp_rank: int) -> torch.Tensor:
    """A flat copy of a module's parameters written by the ranks of layout ``saved`` (``flats``:
    (pp_rank, tp_rank) -> that rank's flat copy, one replica's) -> the flat copy of the module
    whose parameters are ``named`` ((name, shape) in order) on tensor-parallel rank ``tp_rank``
    of ``tp``: each parameter made whole from the saved slices of the first stage that holds it
    (a pipeline replica is the first stage's copy; a tied lm_head the embedding) and cut by the
    same TP plan the layout-free state uses (:func:`shard_dim`, :func:`bounds`), one parameter
    at a time."""
    s_tp, s_pp = int(saved.get("tp", 1) or 1), int(saved.get("pp", 1) or 1)
    entries = flat_entries(cfg, s_tp, s_pp, saved.get("pp_split"))
    where: dict[str, tuple[int, int]] = {}  # name -> (stage, index in its entries)
    for stage, ranks in enumerate(entries):
        for i, (name, _, _) in enumerate(ranks[0]):
            where.setdefault(name, (stage, i))
    for (p, t), flat in flats.items():
        last = entries[p][t][-1] if entries[p][t] else None
        size = 0 if last is None else last[2] + math.prod(last[1])
        if flat.numel() != size:
            raise CheckpointError(f"a flat copy of parameters of pipeline stage {p}, tensor-parallel rank {t} of "
                                  f"layout {format_layout(saved)} holds {flat.numel()} values, {size} by the model's "
                                  "config: the checkpoint and its config.yaml do not belong together")
    tied = bool(getattr(cfg, "tie_embeddings", False))
    named = [(n, tuple(shape)) for n, shape in named]
    dtype = next(iter(flats.values())).dtype if flats else torch.float32
    out, at = torch.empty(sum(math.prod(shape) for _, shape in named), dtype=dtype), 0
    for name, shape in named:
        stored = "embed.weight" if name not in where and tied and name == "lm_head.weight" else name
        if stored not in where:
            raise CheckpointError(f"no stage of layout {format_layout(saved)} holds parameter '{name}' "
                                  "(model.lora or the model differ?)")
        stage, i = where[stored]
        dim = shard_dim(stored)
        parts = []
        for t in range(s_tp) if dim is not None else (0,):
            _, cut, offset = entries[stage][t][i]
            parts.append(flats[(stage, t)][offset:offset + math.prod(cut)].view(cut))
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        if dim is not None:
            a, b = bounds(full.shape[dim], tp)[tp_rank]
            full = full.narrow(dim, a, b - a)
        if tuple(full.shape) != tuple(shape):
            raise CheckpointError(f"parameter '{name}' is {tuple(full.shape)} when re-cut from layout "
                                  f"{format_layout(saved)} for tp rank {tp_rank} of {tp}, {tuple(shape)} in this model")
        out[at:at + full.numel()] = full.reshape(-1)
        at += full.numel()
    return out


# ------------------------------------------------------------------------------------------
# DeepSpeed's universal checkpoint (interoperability: the tests compare our merge with its)
# ------------------------------------------------------------------------------------------

def universal_checkpoint_info(cfg: ModelConfig) -> dict:
    """The ``universal_checkpoint_info`` DeepSpeed's converter needs to merge tensor-parallel
    slices into full tensors (TP_TABLE): row-parallel weights are concatenated on dim 1,
    replicated parameters are kept once, everything else is concatenated on dim 0;
    ``null_memory`` lives on every pipeline stage: the first stage's copy is kept. Saved with
    every checkpoint, so DeepSpeed's own tools read our shards."""
    from rlt_mega.model.rlt import build_model

    names = [n for n, _ in build_model(cfg, "meta").named_parameters()]
    exact = lambda n: re.escape(n) + "$"  # noqa: E731
    return {
        "universal_checkpoint_version": 0.4,
        "tp_replicated_parameter_patterns": [exact(n) for n in names if param_shard_dim(n) is None],
        "parameter_with_row_parallelism_patterns": [exact(n) for n in names if param_shard_dim(n) == 1],
        "pipeline_replicated_parameter_patterns": [exact("null_memory")],
    }


def to_universal(ds_dir: Path, out_dir: Path, workers: int = 1) -> None:
    """DeepSpeed's ``ds_to_universal`` on one checkpoint tag directory (``step_N/deepspeed``) ->
    ``out_dir``. Its progress output is logged at debug level; a failure is a CheckpointError
    carrying the converter's last lines."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(ds_dir), output_folder=str(out_dir), num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ds_to_universal.main(args)
    except Exception as exc:  # the converter raises asserts, RuntimeErrors, FileNotFoundErrors...
        tail = "\n".join(out.getvalue().splitlines()[-5:])
        raise CheckpointError(f"DeepSpeed's universal-checkpoint converter failed on {ds_dir} "
                              f"({type(exc).__name__}: {exc}); its last output:\n{tail}") from exc
    log.debug("ds_to_universal %s:\n%s", ds_dir, out.getvalue())


def iter_owned(named: Iterable[tuple[str, object]], skip: set, tp_rank: int, dp_rank: int, dp: int
               ) -> Iterator[tuple[str, object, bool]]:
    """(name, parameter, whether this rank writes it) over a stage's trained parameters in order,
    pipeline replicas (``skip``) left out: every rank walks the same list (the reads may be
    collectives), one rank per parameter keeps it."""
    index = 0
    for name, p in named:
        if name in skip:
            continue
        yield name, p, owner(index, name, tp_rank, dp_rank, dp)
        index += 1


# ------------------------------------------------------------------------------------------
# What a move costs, from the config alone
# ------------------------------------------------------------------------------------------

def _stage_params(cfg: ModelConfig, pp: int, pp_split) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Per pipeline stage, (name, full shape) of the parameters it holds (meta tensors)."""
    from rlt_mega.model.rlt import build_model
    from rlt_mega.parallel.dims import split_layers
    from rlt_mega.parallel.stage import prune_to_stage

    out = []
    stages = split_layers(cfg.n_layers, pp, pp_split)
    for pp_rank, layers in enumerate(stages):
        model = build_model(cfg, "meta")
        if pp > 1:
            prune_to_stage(model, layers, pp_rank == 0, pp_rank == pp - 1)
        out.append([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    return out


def _slice_numel(name: str, shape: tuple[int, ...], tp: int, tp_rank: int) -> int:
    dim, n = shard_dim(name), math.prod(shape)
    if dim is None:
        return n
    a, b = bounds(shape[dim], tp)[tp_rank]
    return n // shape[dim] * (b - a)


def _rows(name: str, shape: tuple[int, ...], tp: int, tp_rank: int) -> int:
    """Rows (first dimension) of a parameter's TP slice (0: a scalar)."""
    if not shape:
        return 0
    if shard_dim(name) == 0:
        a, b = bounds(shape[0], tp)[tp_rank]
        return b - a
    return shape[0]


def _share(name: str, shape: tuple[int, ...], tp: int, tp_rank: int, dp: int) -> int:
    """Elements of one key of a parameter's TP slice that data-parallel rank 0 of ``dp`` reads on
    resume (ds_state.py ``_read_once``: the first ceil(rows / dp) rows; a slice of fewer rows
    than ranks whole)."""
    n, rows = _slice_numel(name, shape, tp, tp_rank), _rows(name, shape, tp, tp_rank)
    if dp == 1 or rows < dp:
        return n
    return -(-rows // dp) * (n // rows)


def _per_rank(cfg: ModelConfig, layout_tp: int, layout_pp: int, split, dp: int) -> tuple[int, int]:
    """Writing: (most bytes one rank writes, largest TP slice in elements) over the layout's
    ranks, each data-parallel rank writing its share of the parameters."""
    most, biggest, seen = 0, 0, set()
    for stage in _stage_params(cfg, layout_pp, split):
        names = [(n, s) for n, s in stage if n not in seen]
        seen |= {n for n, _ in stage}
        for t in range(layout_tp):
            for d in range(dp):
                mine = [_slice_numel(n, s, layout_tp, t) for i, (n, s) in enumerate(names) if owner(i, n, t, d, dp)]
                most = max(most, 12 * sum(mine))
                biggest = max([biggest] + mine)
    return most, biggest


def _resume_reads(cfg: ModelConfig, tp: int, pp: int, split, dp: int) -> dict:
    """Resuming on (tp, pp, dp): every tensor-parallel rank of a stage needs its TP slices; its
    data-parallel group reads each once, a share of the rows per rank, and all-gathers them
    (ds_state.py ``_read_once``). In bytes: read by all ranks, most read by one rank, most one
    rank receives from the all-gathers; and the largest slice in elements."""
    total = most = gathered = biggest = 0
    for stage in _stage_params(cfg, pp, split):
        for t in range(tp):
            held = share = 0
            for n, s in stage:
                numel = _slice_numel(n, s, tp, t)
                held, share, biggest = held + numel, share + _share(n, s, tp, t, dp), max(biggest, numel)
                total += 12 * numel * (dp if _rows(n, s, tp, t) < dp else 1)
            most, gathered = max(most, 12 * share), max(gathered, 12 * (held - share))
    return {"bytes_read": total, "most_per_rank": most, "gathered_per_rank": gathered, "largest_slice": biggest}


def reshard_cost(cfg: ModelConfig, src: dict, dst: dict, bucket_bytes: int = BUCKET_BYTES) -> dict:
    """Bytes read and written and the peak memory of moving a checkpoint of layout ``src`` to
    ``dst`` (dicts with tp, pp, dp, zero_stage[, pp_split]), full fine-tuning (every parameter
    trained), computed from the model config:

    * ``save``: what writing the layout-free state adds to every checkpoint on ``src``: 12 bytes
      (fp32 master, exp_avg, exp_avg_sq) per parameter in all; per rank, the most one rank
      writes and its peak (one bucket of pending writes plus one parameter's TP slice gathered
      over the data-parallel group, three tensors);
    * ``resume``: ``train.resume`` on ``dst``: every rank needs its TP slice of its stage's
      parameters; its data-parallel group reads each slice once (each rank a share of the rows)
      and all-gathers it; per rank the most read, the most received from the all-gathers and
      the peak (one parameter's slice, three tensors, and one being gathered: 16 bytes per
      element, beside the engine's own memory); nothing written before the next save;
    * ``offline``: ``rlt-mega reshard`` on one process: reads each stored tensor once, writes
      each once, streamed (checkpoint_tools/reshard_ckpt.py): peak one key of the largest slice,
      twice where tensor-parallel pieces are joined (8 bytes per element).
    """
    tp_s, pp_s, dp_s = (src.get(k, 1) for k in ("tp", "pp", "dp"))
    tp_d, pp_d, dp_d = (dst.get(k, 1) for k in ("tp", "pp", "dp"))
    stored: dict[str, tuple[int, ...]] = {}
    for stage in _stage_params(cfg, 1, None):
        stored.update(stage)
    total = 12 * sum(math.prod(s) for s in stored.values())
    largest = max(math.prod(s) for s in stored.values())

    save_most, save_slice = _per_rank(cfg, tp_s, pp_s, src.get("pp_split"), dp_s)
    reads = _resume_reads(cfg, tp_d, pp_d, dst.get("pp_split"), dp_d)
    return {
        "parameters": total // 12, "largest_parameter": largest,
        "save": {"bytes_written": total, "most_per_rank": save_most,
                 "peak_per_rank": min(bucket_bytes, save_most) + 12 * save_slice},
        "resume": {"bytes_read": reads["bytes_read"], "most_per_rank": reads["most_per_rank"],
                   "gathered_per_rank": reads["gathered_per_rank"], "peak_per_rank": 16 * reads["largest_slice"],
                   "ranks": tp_d * pp_d * dp_d},
        "offline": {"bytes_read": total, "bytes_written": total, "peak": 8 * _largest_slice(stored, tp_d)},
    }


def _largest_slice(stored: dict[str, tuple[int, ...]], tp: int) -> int:
    return max(_slice_numel(n, s, tp, 0) for n, s in stored.items())


def format_cost(src: dict, dst: dict, cost: dict) -> str:
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    s, r, o = cost["save"], cost["resume"], cost["offline"]
    return "\n".join([
        f"reshard {format_layout(src)} -> {format_layout(dst)} ({changes(src, dst)}); {cost['parameters']:,} "
        f"parameters (largest {cost['largest_parameter']:,}), 12 bytes each in the layout-free state "
        "(fp32 master, exp_avg, exp_avg_sq)",
        f"  every checkpoint on {format_layout(src)} writes the state: {gb(s['bytes_written'])} in all, at most "
        f"{gb(s['most_per_rank'])} per rank, peak {gb(s['peak_per_rank'])} per rank (one bucket + one slice)",
        f"  train.resume on {format_layout(dst)}: {r['ranks']} ranks read {gb(r['bytes_read'])} in all (each TP "
        f"slice once per data-parallel group), at most {gb(r['most_per_rank'])} per rank, and receive at most "
        f"{gb(r['gathered_per_rank'])} per rank from the group's all-gathers; peak {gb(r['peak_per_rank'])} per "
        "rank beside the engine (one parameter's slice); nothing written until the next save",
        f"  rlt-mega reshard (one process): reads {gb(o['bytes_read'])}, writes {gb(o['bytes_written'])}, "
        f"peak {gb(o['peak'])} (one tensor of the largest slice, twice where pieces are joined)",
    ])
