"""Load a Hugging Face checkpoint directory: config.json + (sharded) safetensors, validated by name and shape.

FP8 (e4m3 + `weight_scale_inv`, 128x128 blocks) is dequantised at load time into the engine dtype:
W[i, j] = W8[i, j] * scale_inv[i // 128, j // 128]. We chose load-time dequantisation because every
matmul in this engine runs in the model dtype on CPU; an FP8 kernel path would not be faster here.
"""
from __future__ import annotations

import json
import os
from glob import glob

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig, overrides_indexer_schedule

FP8_BLOCK = 128
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names of the dtypes a weight may be stored in
FP8_DTYPE = "F8_E4M3"  # with its block scales (`{name}_scale_inv`)
# test hook: "<checkpoint directory's name>:<tensor>,...": reading those tensors fails as bad bytes would
LOAD_FAULT_ENV = "SPARSEKV_INJECT_LOAD_FAULT"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensors."""


def _layer_shapes(cfg: ModelConfig, i: int, has_indexer: bool, mlp_type: str) -> dict[str, tuple]:
    H, hid, C, R = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
    s = {
        f"{p}.input_layernorm.weight": (hid,), f"{p}.post_attention_layernorm.weight": (hid,),
        f"{a}.q_a_proj.weight": (cfg.q_lora_rank, hid), f"{a}.q_a_layernorm.weight": (cfg.q_lora_rank,),
        f"{a}.q_b_proj.weight": (H * cfg.qk_head_dim, cfg.q_lora_rank),
        f"{a}.kv_a_proj_with_mqa.weight": (C + R, hid), f"{a}.kv_a_layernorm.weight": (C,),
        f"{a}.kv_b_proj.weight": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C),
        f"{a}.o_proj.weight": (hid, H * cfg.v_head_dim),
    }
    if has_indexer:
        D, HI = cfg.index_head_dim, cfg.index_n_heads
        s.update({f"{a}.indexer.wq_b.weight": (HI * D, cfg.q_lora_rank), f"{a}.indexer.wk.weight": (D, hid),
                  f"{a}.indexer.k_norm.weight": (D,), f"{a}.indexer.k_norm.bias": (D,),
                  f"{a}.indexer.weights_proj.weight": (HI, hid)})
    s.update(_ffn_shapes(cfg, f"{p}.mlp", mlp_type))
    return s


def _mlp_shapes(prefix: str, hid: int, inter: int) -> dict[str, tuple]:
    return {f"{prefix}.gate_proj.weight": (inter, hid), f"{prefix}.up_proj.weight": (inter, hid),
            f"{prefix}.down_proj.weight": (hid, inter)}


def _ffn_shapes(cfg: ModelConfig, prefix: str, mlp_type: str) -> dict[str, tuple]:
    hid = cfg.hidden_size
    if mlp_type == "dense":
        return _mlp_shapes(prefix, hid, cfg.intermediate_size)
    s = {f"{prefix}.gate.weight": (cfg.n_routed_experts, hid),
         f"{prefix}.gate.e_score_correction_bias": (cfg.n_routed_experts,)}
    for e in range(cfg.n_routed_experts):
        s.update(_mlp_shapes(f"{prefix}.experts.{e}", hid, cfg.moe_intermediate_size))
    s.update(_mlp_shapes(f"{prefix}.shared_experts", hid, cfg.moe_intermediate_size * cfg.n_shared_experts))
    return s


def expected_shapes(cfg: ModelConfig, tie_lm_head: bool = False) -> dict[str, tuple]:
    """Every tensor the main model needs (the MTP layer is handled separately: it is optional)."""
    s = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not tie_lm_head:
        s["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        s.update(_layer_shapes(cfg, i, cfg.indexer_types[i] == "full", cfg.mlp_layer_types[i]))
    return s


def mtp_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(required, optional) tensors of the NextN layer `model.layers.{num_hidden_layers}`."""
    i, hid = cfg.num_hidden_layers, cfg.hidden_size
    p = f"model.layers.{i}"
    req = _layer_shapes(cfg, i, True, "sparse" if cfg.n_routed_experts else "dense")
    req.update({f"{p}.enorm.weight": (hid,), f"{p}.hnorm.weight": (hid,), f"{p}.eh_proj.weight": (hid, 2 * hid),
                f"{p}.shared_head.norm.weight": (hid,)})
    opt = {f"{p}.embed_tokens.weight": (cfg.vocab_size, hid), f"{p}.shared_head.head.weight": (cfg.vocab_size, hid)}
    return req, opt


def list_tensor_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors.index.json or by scanning the shards."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:  # the last two: not a JSON object
            raise CheckpointError(f"{index}: not a JSON object with a weight_map ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        missing_files = sorted({v for v in weight_map.values() if not os.path.exists(os.path.join(path, v))})
        if missing_files:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing_files[:5])}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files found")
    names = {}
    for file in files:
        with _opened(file) as f:
            names.update({k: file for k in f.keys()})
    return names


def _opened(file: str):
    """safe_open(file), a file that is not safetensors (truncated, corrupt) a CheckpointError."""
    try:
        return safe_open(file, "pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def check_stored_format(where: str, name: str, dtype: str, shape: tuple, scale_shape: tuple | None) -> None:
    """A weight stored as a float, or as FP8 e4m3 with its 128x128 block scales (`scale_shape`: its
    `_scale_inv`'s, None without one); `dtype` is safetensors' name. Anything else would load as some
    other number (an int, a bool, e5m2 without scales) or ignore a scale, and compute other tokens."""
    if dtype == FP8_DTYPE:
        if scale_shape is None:
            raise CheckpointError(f"{where}: FP8 tensor {name} has no {name}_scale_inv")
        blocks = tuple(-(-n // FP8_BLOCK) for n in shape)
        if len(shape) != 2 or tuple(scale_shape) != blocks:
            raise CheckpointError(f"{where}: {name}_scale_inv has shape {tuple(scale_shape)}; a 2-D FP8 tensor of "
                                  f"shape {tuple(shape)} needs {blocks} (128x128 blocks)")
    elif dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{where}: tensor {name} is {dtype}: a weight must be a float "
                              f"({', '.join(FLOAT_DTYPES)}) or {FP8_DTYPE} with 128x128 block scales")
    elif scale_shape is not None:
        raise CheckpointError(f"{where}: {name}_scale_inv given, but {name} is {dtype}, not {FP8_DTYPE}")


def _names(items, limit: int = 6) -> str:
    items = sorted(items)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _is_main_indexer(cfg: ModelConfig, name: str) -> bool:
    return ".self_attn.indexer." in name and int(name.split(".")[2]) < cfg.num_hidden_layers


def check_names(cfg: ModelConfig, available: set[str], path: str, drop_extra_indexers: bool = False) -> dict[str, tuple]:
    """Which tensors to load with their shapes; raises naming missing or unexpected tensors.

    drop_extra_indexers: the config was overridden to share more indexers than the checkpoint has;
    indexer tensors of layers that became "shared" are then skipped instead of rejected.
    """
    weights = {n for n in available if not n.endswith(".weight_scale_inv")}
    tie = cfg.tie_word_embeddings and "lm_head.weight" not in weights
    want = expected_shapes(cfg, tie_lm_head=tie)
    mtp_req, mtp_opt = mtp_shapes(cfg)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    if any(n.startswith(mtp_prefix) for n in weights):
        missing_mtp = set(mtp_req) - weights
        if missing_mtp:
            raise CheckpointError(f"{path}: MTP layer {cfg.num_hidden_layers} is incomplete; missing {_names(missing_mtp)}")
        want.update(mtp_req)
        want.update({k: v for k, v in mtp_opt.items() if k in weights})
    missing = set(want) - weights
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {_names(missing)}")
    unexpected = weights - set(want) - {n for n in weights if n.endswith("rotary_emb.inv_freq")}
    if drop_extra_indexers:
        unexpected = {n for n in unexpected if not _is_main_indexer(cfg, n)}
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) {_names(unexpected)} "
                              f"(check indexer_types: 'shared' layers carry no indexer tensors)")
    return want


def dequantize_fp8(w8: torch.Tensor, scale_inv: torch.Tensor, name: str,
                   full_shape: tuple[int, int] | None = None, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """W8 * its 128x128 block scales. A slice of a tensor (tensor parallelism) gives the whole tensor's
    shape and the slice's first (row, column): each element keeps the scale of its block."""
    out, inp = full_shape or w8.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    if tuple(scale_inv.shape) != (rows, cols):
        raise CheckpointError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)}, expected {(rows, cols)} for 128x128 blocks")
    r = torch.arange(offset[0], offset[0] + w8.shape[0]) // FP8_BLOCK
    c = torch.arange(offset[1], offset[1] + w8.shape[1]) // FP8_BLOCK
    return w8.float() * scale_inv.float()[r][:, c]


def _handle(files: dict[str, str], name: str, handles: dict):
    file = files[name]
    if file not in handles:
        handles[file] = _opened(file)
    return handles[file]


def _header(files: dict[str, str], name: str, handles: dict, path: str):
    """The tensor's slice handle (its header), a file that does not hold it a CheckpointError."""
    try:
        return _handle(files, name, handles).get_slice(name)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: {files[name]} does not hold {name} as its index says ({e})") from None


def check_header(files: dict[str, str], name: str, shape: tuple, handles: dict, path: str) -> None:
    """The tensor's stored shape and format, from the safetensors headers (no weights read)."""
    part = _header(files, name, handles, path)
    found = tuple(part.get_shape())
    if found != tuple(shape):
        raise CheckpointError(f"{path}: tensor {name} has shape {found}, config implies {tuple(shape)}")
    scale = name + "_scale_inv"
    scale_shape = tuple(_header(files, scale, handles, path).get_shape()) if scale in files else None
    check_stored_format(path, name, part.get_dtype(), found, scale_shape)


def _read(files: dict[str, str], name: str, handles: dict, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The tensor, or only its slice (dim, start, end): safetensors reads just those bytes."""
    if shard is None:
        return _handle(files, name, handles).get_tensor(name)
    dim, start, end = shard
    part = _handle(files, name, handles).get_slice(name)
    return part[start:end] if dim == 0 else part[:, start:end]


def _load_one(files, name: str, shape: tuple, handles: dict, path: str, layout) -> torch.Tensor:
    check_header(files, name, shape, handles, path)
    if f"{os.path.basename(os.path.normpath(path))}:{name}" in os.environ.get(LOAD_FAULT_ENV, "").split(","):
        raise CheckpointError(f"{path}: cannot read {name} (an injected fault)")
    shard = layout.shard(name, tuple(shape)) if layout is not None else None
    try:
        t = _read(files, name, handles, shard)
        if t.dtype == torch.float8_e4m3fn:
            offset = (0, 0) if shard is None else ((shard[1], 0) if shard[0] == 0 else (0, shard[1]))
            t = dequantize_fp8(t, _read(files, name + "_scale_inv", handles), name, tuple(shape), offset)
    except SafetensorError as e:  # bytes missing past a valid header: a file cut short
        raise CheckpointError(f"{path}: {files[name]}: cannot read {name} ({e})") from None
    return t


def as_stored(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor as the model keeps it: the model dtype, but fp32 for the router's correction bias and
    the indexer's head weights (as the reference computes them)."""
    keep_fp32 = name.endswith("e_score_correction_bias") or name.endswith("weights_proj.weight")
    return t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()


def checkpoint_listing(path: str, cfg: ModelConfig, drop_extra_indexers: bool = False) -> tuple[dict, dict]:
    """(the file of each tensor, the shape of each tensor the model needs), checked against the config:
    what `load_tensors` reads by, listed once for a caller that reads a checkpoint part by part."""
    files = list_tensor_files(path)
    return files, check_names(cfg, set(files), path, drop_extra_indexers)


def load_tensors(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 drop_extra_indexers: bool = False, layout=None, only: set[str] | None = None,
                 listing: tuple[dict, dict] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor the model needs (or the names in `only` among them), checked against the config;
    with a `ParallelLayout`, only this rank's slices (no rank ever reads the whole model). `listing`:
    the checkpoint's `checkpoint_listing`, when the caller has it already."""
    files, want = listing or checkpoint_listing(path, cfg, drop_extra_indexers)
    handles: dict = {}
    out = {}
    try:
        for name, shape in want.items():
            if (layout is not None and not layout.holds(name, cfg)) or (only is not None and name not in only):
                continue
            read = _load_one(files, name, shape, handles, path, layout)
            t = as_stored(name, read, dtype, device)
            # NOTE: a tensor read whole on the host may be the file's mapped pages: a trainer writing a new
            # checkpoint over this one would change the weights being served, so keep a copy instead
            out[name] = t.clone() if t.untyped_storage().data_ptr() == read.untyped_storage().data_ptr() else t
    finally:
        handles.clear()  # the files' mappings go now, not with a kept error's frames
    return out


def files_stamp(path: str) -> list:
    """What tells whether a checkpoint directory changed since: name, size, inode and modification
    time of config.json and of each safetensors file (stat calls only, no reads)."""
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith((".safetensors", ".json")))
    stats = [(n, os.stat(os.path.join(path, n))) for n in names]
    return [(n, st.st_size, st.st_ino, st.st_mtime_ns) for n, st in stats]


def load_model(path: str, dtype: torch.dtype, device: torch.device, overrides: dict | None = None,
               selector: str = "dsa", quest_page_tokens: int = 16, layout=None, comm=None):
    """The model with its token selector: the checkpoint's lightning indexers (DSA), or Quest over
    pages of `quest_page_tokens` positions (its per-page state is sized with the cache). With a
    `ParallelLayout` and its group's `comm`: this rank's shard (parallel/layout.py)."""
    from .model import SINGLE_RANK, DSAModel
    from .selectors import install_quest
    stamp = files_stamp(path)  # NOTE: before the reads: files written while they run count as changed since
    cfg = ModelConfig.from_json(path, overrides)
    if layout is not None:
        layout.check_model(cfg)
    tensors = load_tensors(path, cfg, dtype, device, overrides_indexer_schedule(overrides), layout)
    model = DSAModel(cfg, tensors, dtype, device, comm or SINGLE_RANK, release=True)
    del tensors
    if selector == "quest":
        install_quest(model, quest_page_tokens)
    model.loaded_stamp = stamp  # the checkpoint as it was read (weights.WeightSource)
    return model
