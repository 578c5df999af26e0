"""The export format: one layout-independent directory per model (docs/design.md,
"Checkpoints").

::

    out_dir/
      config.json             {"model_type": "rlt", <every ModelConfig field>, + the
                              keys transformers reads: auto_map, architectures,
                              token ids, dtype}
      model.safetensors       full (unsharded) tensors under the single-process
                              names, or model-0000k-of-0000n.safetensors +
                              model.safetensors.index.json above a size limit
      rlt_export.json         format version, sha256/shape/dtype of every tensor,
                              tied names, the tokenizer files, where the weights
                              came from
      configuration_rlt.py,   the model for transformers, needing nothing of
      modeling_rlt.py         rlt_mega: AutoModelForCausalLM.from_pretrained(
                              out_dir, trust_remote_code=True)
      tokenizer.json ...,     when a tokenizer was given (AutoTokenizer loads them;
      generation_config.json  hf_files.py says what is written for which tokenizer)

Tied weights (``lm_head.weight`` when model.tie_embeddings) are stored once, under
``embed.weight``; :func:`load_exported` puts the alias back, so the state dict it returns
loads into ``RLT(cfg)`` with ``load_state_dict(strict=True)``.

A directory is checked on every load: the tensor names and shapes against config.json and
the bytes of every tensor against its sha256. A damaged or inconsistent export is an error
that names the file and the tensor, never a model that silently computes something else.

model.arch: a ``dense`` export is a standard Llama/Qwen2 checkpoint (hf_dense.py: HF config.json
and tensor names, no modeling code); a ``looped`` one is this format without modeling code
(transformers has no looped model). Both keep rlt_export.json.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from rlt_mega.config import ConfigError, ModelConfig, from_dict
from rlt_mega.log import get_logger
from rlt_mega.model.rlt import RLT, build_model
from rlt_mega.precision import parse_storage_dtype as parse_dtype
import rlt_mega.checkpoint_tools.hf_dense as hf_dense  # the module, not the package (whose __init__ imports this one)
import rlt_mega.checkpoint_tools.hf_files as hf_files
from rlt_mega.checkpoint_tools.files import (
    EXPORT_MANIFEST, CheckpointFormatError, SafetensorsDir, atomic_directory, dtype_name, read_json, save_safetensors,
    tensor_sha256, write_json,
)

log = get_logger(__name__)

CONFIG_NAME = "config.json"
MANIFEST_NAME = EXPORT_MANIFEST
MODEL_TYPE = "rlt"
FORMAT = "rlt_mega.export"
# 2: config.json also holds transformers' keys (hf_files.HF_CONFIG_KEYS), and the directory
# the modeling code; version 1 directories still load.
FORMAT_VERSION = 2
DEFAULT_MAX_SHARD_SIZE = "5GB"
TOKENIZER_FILES = hf_files.TOKENIZER_FILES

# ModelConfig fields that fix the set of parameters and their shapes. The others (memory_block,
# rope_theta, norm_eps, max_seq_len, init_std) change what the weights compute, not what they are.
SHAPE_FIELDS = ("arch", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                "share_weights", "tie_embeddings", "qkv_bias")

# ----------------------------------------------------------------------------------------
# config.json and what a config implies
# ----------------------------------------------------------------------------------------

def config_to_json(cfg: ModelConfig, hf: Optional[dict] = None) -> dict:
    """config.json: every ModelConfig field, then ``hf`` (hf_files.hf_config: what transformers reads)."""
    return {"model_type": MODEL_TYPE, **dataclasses.asdict(cfg), **(hf or {})}


def read_config(path: str | Path) -> ModelConfig:
    """Reads ``config.json`` of an export directory (or the file itself) strictly."""
    path = Path(path)
    file = path if path.suffix == ".json" else path / CONFIG_NAME
    data = read_json(file, "an exported RLT directory holds config.json (the model config); "
                           "export with `rlt-mega export` or `rlt-mega import`")
    model_type = data.pop("model_type", None)
    if model_type in ("llama", "qwen2") and isinstance(data.get(hf_dense.RLT_KEY), dict):
        data = data[hf_dense.RLT_KEY]  # a dense export: a Llama/Qwen2 checkpoint with its ModelConfig
        model_type = MODEL_TYPE
    for key in hf_files.HF_CONFIG_KEYS:  # transformers' keys, not ModelConfig's
        data.pop(key, None)
    if model_type != MODEL_TYPE:
        hint = (" (a Hugging Face checkpoint: convert it with `rlt-mega import`)"
                if model_type in ("llama", "qwen2") else "")
        raise CheckpointFormatError(f"{file}: model_type is {model_type!r}, not {MODEL_TYPE!r}: this is "
                                    f"not an exported RLT{hint}")
    try:
        return from_dict(data, ModelConfig)
    except ConfigError as exc:
        raise CheckpointFormatError(f"{file}: {exc}") from None


def tied_aliases(cfg: ModelConfig) -> dict[str, str]:
    """Names stored once: alias -> the stored name."""
    return {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict name of ``RLT(cfg)`` (aliases included) and its shape; nothing allocated."""
    return {name: tuple(t.shape) for name, t in build_model(cfg, "meta").state_dict().items()}


def empty_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> RLT:
    """RLT(cfg) with uninitialised storage (no init cost), ready to be loaded into. Re-ties the
    head: ``to_empty`` gives each module a new Parameter when leaving the meta device."""
    model = build_model(cfg, "meta").to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


def _config_summary(cfg: ModelConfig) -> str:
    return ", ".join(f"{f}={getattr(cfg, f)}" for f in SHAPE_FIELDS)


def check_tensors(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, where: str,
                  file_of: Optional[dict[str, Path]] = None) -> None:
    """Checks that ``shapes`` (name -> shape, aliases excluded) are exactly the stored tensors
    of RLT(cfg). ``where`` names the source in errors; ``file_of`` names each tensor's file."""
    aliases = tied_aliases(cfg)
    expected = {n: s for n, s in expected_shapes(cfg).items() if n not in aliases}
    missing = [n for n in expected if n not in shapes]
    extra = [n for n in shapes if n not in expected]
    if missing:
        raise CheckpointFormatError(f"{where}: missing {len(missing)} tensors that the config "
                                    f"({_config_summary(cfg)}) requires, e.g. {missing[:5]}")
    if extra:
        raise CheckpointFormatError(f"{where}: {len(extra)} tensors that an RLT with this config "
                                    f"({_config_summary(cfg)}) does not have, e.g. {extra[:5]}")
    for name, shape in shapes.items():
        if tuple(shape) != expected[name]:
            src = file_of[name] if file_of else where
            raise CheckpointFormatError(
                f"{src}: tensor '{name}' has shape {tuple(shape)}, but the config "
                f"({_config_summary(cfg)}) needs {expected[name]}: the weights and the config "
                "do not belong together")


# ----------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------

def _store_once(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Drops tied aliases after checking they really are the stored tensor's values."""
    out = dict(sd)
    for alias, target in tied_aliases(cfg).items():
        if alias in out:
            if target in out and not torch.equal(out[alias], out[target]):
                raise ValueError(f"model.tie_embeddings is true but '{alias}' differs from '{target}': "
                                 "the state dict does not match its config")
            del out[alias]
    return out


def export_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
                      tokenizer: Optional[str | Path] = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                      dtype: Optional[str | torch.dtype] = None, source: Optional[dict] = None,
                      overwrite: bool = False, inputs: Iterable[str | Path] = ()) -> Path:
    """Writes a full single-process state dict of RLT(cfg) as an export directory (atomically);
    ``inputs``: the directories it was read from, which the output may not replace
    (checkpoint.check_output)."""
    cast = parse_dtype(dtype)
    sd = _store_once(state_dict, cfg)
    check_tensors({n: tuple(t.shape) for n, t in sd.items()}, cfg, "the state dict to export")
    stored_as = hf_dense.file_names(cfg)  # a dense model: the Llama/Qwen2 names
    sd = {stored_as.get(n, n): (t.detach().to("cpu", cast if cast is not None and t.is_floating_point() else t.dtype)
                                .contiguous()) for n, t in sd.items()}
    tensors = {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "sha256": tensor_sha256(t)}
               for n, t in sd.items()}
    out = Path(out_dir)
    float_dtypes = {t.dtype for t in sd.values() if t.is_floating_point()}
    with atomic_directory(out, overwrite=overwrite, inputs=inputs) as tmp:
        files = save_safetensors(sd, tmp, max_shard_size)
        tok, tokenizer_read = hf_files.write_tokenizer(tokenizer, tmp, cfg)
        hf_files.check_vocab(tokenizer_read, cfg, str(out))
        special = hf_files.special_token_ids(tokenizer_read)
        stored_dtype = float_dtypes.pop() if len(float_dtypes) == 1 else None
        if cfg.arch == "dense":
            write_json(tmp / CONFIG_NAME, hf_dense.hf_dense_config(cfg, special, stored_dtype))
        elif cfg.arch == "looped":  # no modeling code: transformers cannot run it
            hf = hf_files.hf_config(cfg, special, stored_dtype)
            write_json(tmp / CONFIG_NAME, config_to_json(cfg, {k: v for k, v in hf.items()
                                                               if k not in ("auto_map", "architectures")}))
        else:
            write_json(tmp / CONFIG_NAME, config_to_json(cfg, hf_files.hf_config(cfg, special, stored_dtype)))
            hf_files.write_code(tmp)
        hf_files.write_generation_config(tmp, special)
        write_json(tmp / MANIFEST_NAME, {
            "format": FORMAT, "format_version": FORMAT_VERSION, "files": files,
            "tied": tied_aliases(cfg), "tokenizer": tok, "source": source or {}, "tensors": tensors,
        })
    log.info("exported %d tensors (%s) to %s", len(sd), ", ".join(files), out)
    return out


def export_model(model_or_state_dict: nn.Module | dict[str, torch.Tensor], cfg: Optional[ModelConfig],
                 out_dir: str | Path, tokenizer_dir: Optional[str | Path] = None,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, **kwargs) -> Path:
    """Exports a single-process RLT (or its state dict). ``cfg`` defaults to ``model.cfg``;
    keyword arguments go to :func:`export_state_dict` (dtype, source, overwrite)."""
    if isinstance(model_or_state_dict, nn.Module):
        cfg = cfg if cfg is not None else getattr(model_or_state_dict, "cfg", None)
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = model_or_state_dict
    if cfg is None:
        raise ValueError("export_model needs the ModelConfig (pass cfg=...) for a plain state dict")
    kwargs.setdefault("source", {"kind": "model"})
    return export_state_dict(state_dict, cfg, out_dir, tokenizer=tokenizer_dir,
                             max_shard_size=max_shard_size, **kwargs)


# ----------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------

def read_manifest(path: str | Path) -> dict:
    file = Path(path) / MANIFEST_NAME
    manifest = read_json(file, "an exported RLT directory holds it (checksums, tied names); "
                               "export with `rlt-mega export` or `rlt-mega import`")
    if manifest.get("format") != FORMAT:
        raise CheckpointFormatError(f"{file}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointFormatError(f"{file}: format_version {manifest['format_version']} is newer than "
                                    f"this rlt_mega reads ({FORMAT_VERSION}): upgrade rlt_mega")
    if not isinstance(manifest.get("tensors"), dict):
        raise CheckpointFormatError(f"{file}: no 'tensors' table (name -> shape, dtype, sha256)")
    return manifest


def open_export(path: str | Path) -> tuple[ModelConfig, dict, SafetensorsDir]:
    """Opens an export directory and checks everything the headers can tell (names, shapes,
    dtypes against config.json and the manifest) without reading tensor data."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: not a directory; an exported RLT is a directory with "
                                    f"{CONFIG_NAME}, {MANIFEST_NAME} and model.safetensors")
    cfg = read_config(path)
    manifest = read_manifest(path)
    st = SafetensorsDir(path)
    try:
        ours = {stored: n for n, stored in hf_dense.file_names(cfg).items()}  # file name -> model name
        file_of = {ours.get(n, n): f for n, f in st.file_of.items()}
        check_tensors({ours.get(n, n): st.shape(n) for n in st.names()}, cfg, str(path), file_of)
        shapes = {n: st.shape(n) for n in st.names()}
        listed = manifest["tensors"]
        if set(listed) != set(shapes):
            diff = sorted(set(listed) ^ set(shapes))
            raise CheckpointFormatError(f"{path / MANIFEST_NAME}: lists other tensors than the safetensors "
                                        f"files hold (e.g. {diff[:5]}): the files come from different exports")
        for name in shapes:
            if dtype_name(st.dtype(name)) != listed[name].get("dtype"):
                raise CheckpointFormatError(f"{st.file_of[name]}: tensor '{name}' is "
                                            f"{dtype_name(st.dtype(name))}, but {MANIFEST_NAME} says "
                                            f"{listed[name].get('dtype')}")
    except BaseException:
        st.close()
        raise
    return cfg, manifest, st


def load_exported(path: str | Path, device: str | torch.device = "cpu", *,
                  keys: Optional[Iterable[str]] = None, verify: bool = True,
                  dtype: Optional[str | torch.dtype] = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Loads an export directory -> (cfg, state dict of RLT(cfg) with tied aliases restored).

    ``keys`` loads only those names (a pipeline stage loads its own layers; a tied alias brings
    its stored tensor along, e.g. lm_head.weight -> embed.weight as well); ``verify``
    compares every loaded tensor with its sha256; ``dtype`` casts floating tensors.
    """
    cast = parse_dtype(dtype)
    cfg, manifest, st = open_export(path)
    aliases = tied_aliases(cfg)
    with st:
        wanted = list(st.names()) if keys is None else list(keys)
        sd: dict[str, torch.Tensor] = {}
        stored_as = hf_dense.file_names(cfg)  # model name -> file name (a dense export's HF names)
        ours = {f: n for n, f in stored_as.items()}
        wanted = [ours.get(n, n) for n in wanted] if keys is None else wanted
        for name in wanted:
            stored = aliases.get(name, name)
            in_file = stored_as.get(stored, stored)
            if in_file not in st.file_of:
                raise KeyError(f"{path}: no tensor '{name}' in this export")
            if stored not in sd:
                t = st.get(in_file)
                if verify and tensor_sha256(t) != manifest["tensors"][in_file]["sha256"]:
                    raise CheckpointFormatError(
                        f"{st.file_of[in_file]}: tensor '{in_file}' does not match its sha256 in "
                        f"{MANIFEST_NAME}: the file was changed or damaged after export; export it again")
                if cast is not None and t.is_floating_point():
                    t = t.to(cast)
                sd[stored] = t.to(device)
            sd[name] = sd[stored]
        if keys is None:
            for alias, stored in aliases.items():
                sd[alias] = sd[stored]
    return cfg, sd


def verify_export(path: str | Path) -> dict[str, str]:
    """Checks every tensor of an export against config.json and its sha256, one tensor in memory
    at a time. Returns name -> "ok"; raises CheckpointFormatError on the first problem."""
    cfg, manifest, st = open_export(path)
    result = {}
    with st:
        for name in st.names():
            if tensor_sha256(st.get(name)) != manifest["tensors"][name]["sha256"]:
                raise CheckpointFormatError(
                    f"{st.file_of[name]}: tensor '{name}' does not match its sha256 in {MANIFEST_NAME}: "
                    "the file was changed or damaged after export; export it again")
            result[name] = "ok"
    return result


def check_fits(exported: ModelConfig, run: ModelConfig, path: str | Path) -> None:
    """``train.init_from``: the fields that fix the shapes must agree; the others may differ on
    purpose (a dense import trained with memory_block=4, a longer max_seq_len) and are logged,
    since the weights then compute something other than what they were trained for. model.lora
    is not compared: adapters start at B = 0 on the export, their base (it computes the same)."""
    mismatched = [f"{f}: export {getattr(exported, f)} vs run {getattr(run, f)}"
                  for f in SHAPE_FIELDS if getattr(exported, f) != getattr(run, f)]
    if mismatched:
        raise ConfigError(f"train.init_from={path}: the export's config does not fit model "
                          f"({'; '.join(mismatched)}); set these model.* fields as in {Path(path) / CONFIG_NAME}")
    for f in dataclasses.fields(ModelConfig):
        if f.name not in SHAPE_FIELDS + ("lora",) and getattr(exported, f.name) != getattr(run, f.name):
            log.warning("init_from %s: model.%s is %s in the run but %s in the export", path, f.name,
                        getattr(run, f.name), getattr(exported, f.name))


def init_from(model: RLT, path: str | Path) -> ModelConfig:
    """``train.init_from=PATH``: copies an export's weights into ``model`` (any dtype/device).
    Returns the export's config."""
    device = next(model.parameters()).device
    exported, sd = load_exported(path, device)
    check_fits(exported, model.cfg, path)
    model.load_state_dict(sd, strict=True)
    log.info("initialised the model from %s", path)
    return exported


def init_stage_from(path: str | Path, cfg: ModelConfig, layers: range, is_first_stage: bool,
                    is_last_stage: bool) -> RLT:
    """``train.init_from=PATH`` for one pipeline stage of a distributed run: the RLT with only
    the stage's parameters (parallel.stage.prune_to_stage; names stay global) holding the
    export's weights. Only the stage's tensors are read (``load_exported(keys=...)``, each
    checked against its sha256); the engine then keeps this rank's tensor-parallel slice of each
    by the TP plan (parallel.tp). Nothing is initialised at random, and a rank never holds more
    than its stage at full width. On the CPU, like the seeded build it replaces."""
    from rlt_mega.parallel.stage import prune_to_stage

    model = prune_to_stage(build_model(cfg, "meta"), layers, is_first_stage, is_last_stage)
    keys = list(model.state_dict())
    dtype = next(model.parameters()).dtype
    exported, sd = load_exported(path, "cpu", keys=keys, dtype=dtype)
    check_fits(exported, cfg, path)
    # assign: the loaded tensors become the parameters (no second copy); a tied head is tied again.
    model.load_state_dict({k: sd[k] for k in keys}, strict=True, assign=True)
    if cfg.tie_embeddings and model.embed is not None and model.lm_head is not None:
        model.lm_head.weight = model.embed.weight
    log.info("initialised layers %d..%d%s from %s", layers.start, layers.stop - 1,
             " (+ embedding)" if is_first_stage else "", path)
    return model
