"""Model config view (read from a checkpoint's config.json) and the frozen engine config.

Torch-free: the planner, the scheduler and the tests read configs without importing torch.
The IndexShare schedule is derived exactly as transformers 5.23 does in
`GlmMoeDsaConfig.__post_init__` (see tests/test_config.py, which checks it against transformers).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from .units import MAX_TIMEOUT_S

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


class ConfigError(ValueError):
    """A model or engine configuration that cannot be used; the message names the field."""


def derive_indexer_types(raw: dict, num_layers: int) -> list[str]:
    """IndexShare schedule: explicit list > `index_topk_pattern` > freq/offset (transformers rule);
    DeepSeek-V3.2's config has no schedule: every layer its own indexer, unless the list is given."""
    if raw.get("model_type") == "deepseek_v32":
        return list(raw.get("indexer_types") or ["full"] * num_layers)
    if raw.get("indexer_types") is not None:
        return list(raw["indexer_types"])
    return indexshare_schedule(raw, num_layers)


INDEXER_SCHEDULE_FIELDS = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")


def overrides_indexer_schedule(overrides: dict | None) -> bool:
    """Whether config overrides may turn a checkpoint's own indexers into shared ones (their tensors are
    then skipped, not refused: IndexShare applied to a checkpoint trained without it)."""
    return bool(overrides) and any(name in overrides for name in INDEXER_SCHEDULE_FIELDS)


def indexshare_schedule(raw: dict, num_layers: int) -> list[str]:
    """GLM's IndexShare schedule from `index_topk_pattern`, else from freq/offset (transformers rule)."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            unknown = sorted(set(pattern) - {"F", "S"})
            if unknown:
                raise ConfigError(f"config.json: index_topk_pattern has characters {unknown}; only 'F' and 'S' are allowed")
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    freq = max(raw.get("index_topk_freq") or 1, 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _rope_parameters(raw: dict) -> dict:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a DSA checkpoint's config.json that the engine uses, validated and named."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rope_parameters: dict = field(hash=False)
    indexer_rope_interleave: bool
    num_nextn_predict_layers: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    quantization: dict | None = field(default=None, hash=False)
    attention_norm_eps: float = 1e-6  # q_a/kv_a RMSNorm: hard-coded 1e-6 in transformers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer by MLA: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            m = yarn_mscale(rp["factor"], rp["mscale_all_dim"])
            scale *= m * m
        return scale

    @property
    def mtp_layer_index(self) -> int | None:
        return self.num_hidden_layers if self.num_nextn_predict_layers > 0 else None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{where}: unknown model_type {model_type!r}; sparsekv supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        ds = model_type == "deepseek_v32"
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        missing = [k for k in required if raw.get(k) is None]
        if missing:
            raise ConfigError(f"{where}: missing required field(s) {', '.join(missing)}")
        num_layers = int(raw["num_hidden_layers"])
        first_dense = int(raw.get("first_k_dense_replace", 3))
        mlp_types = raw.get("mlp_layer_types") or (
            ["dense"] * min(first_dense, num_layers) + ["sparse"] * max(num_layers - first_dense, 0))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw.get("intermediate_size", 18432 if ds else 12288)),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
            num_hidden_layers=num_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            n_routed_experts=int(raw.get("n_routed_experts", raw.get("num_local_experts", 256))),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 8)),
            n_group=int(raw.get("n_group", 8 if ds else 1)),
            topk_group=int(raw.get("topk_group", 4 if ds else 1)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            q_lora_rank=int(raw["q_lora_rank"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            index_topk=int(raw.get("index_topk", 2048)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_n_heads=int(raw.get("index_n_heads", 64 if ds else 32)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6 if ds else 1e-5)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 163840 if ds else 202752)),
            mlp_layer_types=tuple(mlp_types),
            indexer_types=tuple(derive_indexer_types(raw, num_layers)),
            rope_parameters=_rope_parameters(raw),
            indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", not ds)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0)),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            quantization=raw.get("quantization_config"),
        )
        cfg.validate(where)
        return cfg

    @classmethod
    def from_json(cls, path: str, overrides: dict | None = None) -> "ModelConfig":
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise ConfigError(f"{file}: no config.json found")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: must hold a JSON object, got a {type(raw).__name__}")
        if overrides:
            raw = {**raw, **overrides}
            if overrides_indexer_schedule(overrides) and "indexer_types" not in overrides:
                # a pattern, frequency or offset override replaces the checkpoint's schedule, for either family
                raw["indexer_types"] = indexshare_schedule(raw, int(raw.get("num_hidden_layers") or 0))
        return cls.from_dict(raw, where=file)

    def validate(self, where: str = "config.json") -> None:
        L = self.num_hidden_layers
        if len(self.indexer_types) != L:
            raise ConfigError(f"{where}: indexer_types has {len(self.indexer_types)} entries, num_hidden_layers is {L}")
        bad = sorted(set(self.indexer_types) - {"full", "shared"})
        if bad:
            raise ConfigError(f"{where}: indexer_types has unknown value(s) {bad}; use 'full' or 'shared'")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ConfigError(f"{where}: layer 0 is 'shared' in indexer_types; the first layer must run its own indexer ('full')")
        if len(self.mlp_layer_types) != L or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(f"{where}: mlp_layer_types must list 'dense'/'sparse' for each of the {L} layers")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{where}: n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"{where}: topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"{where}: qk_rope_head_dim must be even and <= index_head_dim")
        if self.index_topk < 1:
            raise ConfigError(f"{where}: index_topk must be >= 1, got {self.index_topk}")
        rt = self.rope_parameters.get("rope_type")
        if rt not in ("default", "yarn"):
            raise ConfigError(f"{where}: rope_type {rt!r} is not supported (default, yarn)")
        if rt == "yarn" and ("factor" not in self.rope_parameters or
                             "original_max_position_embeddings" not in self.rope_parameters):
            raise ConfigError(f"{where}: yarn rope needs 'factor' and 'original_max_position_embeddings'")

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (e.g. another IndexShare pattern for a benchmark)."""
        new = dataclasses.replace(self, **changes)
        new.validate("override")
        return new


ATTENTION_MODES = ("sparse", "dense")
QUEST_PAGE_TOKENS = 16  # Quest's page (its default): positions per page whose key bounds it keeps
SELECTORS = ("dsa", "quest")
INDEXER_KEY_DTYPES = ("auto", "fp8_e4m3")
DECODE_GRAPH_MODES = ("auto", "off", "eager")
KV_CACHE_DTYPES = ("auto", "fp8")  # latents: the model dtype, or FlashMLA's 656 B FP8 rows (cache/latent_format.py)


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def auto_dtype(checkpoint_dtype: str | None, device_type: str, bf16_supported: bool = True) -> str:
    """What dtype "auto" computes in (vLLM's default, a CPU aside). On CPU, float32: the CPU paths
    compute in float32 (bfloat16 matmuls there are slower without AMX, and outputs drift from the
    float32 reference the parity tests hold). On CUDA, the checkpoint's dtype (config.json `dtype`, or
    `torch_dtype`) when it is a 16-bit one; a float32 checkpoint, an FP8 one that names no 16-bit
    dtype, or none named, computes in bfloat16, or float16 on a GPU without bfloat16."""
    if device_type != "cuda":
        return "float32"
    if checkpoint_dtype in ("bfloat16", "float16") and (checkpoint_dtype == "float16" or bf16_supported):
        return checkpoint_dtype
    return "bfloat16" if bf16_supported else "float16"


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a checkpoint directory's config.json names (`dtype`, or the older `torch_dtype`); None
    when it names none or cannot be read (the checkpoint loader reports that)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    named = raw.get("dtype", raw.get("torch_dtype")) if isinstance(raw, dict) else None
    return named.removeprefix("torch.") if isinstance(named, str) else None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the checkpoint. Frozen: derived sizes live in runtime objects."""

    model: str
    dtype: str = "auto"  # the compute dtype (COMPUTE_DTYPES), or "auto": `auto_dtype` picks it (hub.resolve_config)
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    # The most alternatives a request may ask for per token (`logprobs`, `prompt_logprobs`, the server's
    # `top_logprobs`), vLLM's max_logprobs and its default. Each is a top-k over the vocabulary and a
    # dict per token. vLLM's -1 (no bound) is not offered: the vocabulary's size does that (docs/server.md).
    max_logprobs: int = 20
    kv_page_size: int = 64
    prefill_chunk_tokens: int = 2048
    num_kv_pages: int | None = None
    # How latents are stored: "auto" (the model dtype) or "fp8" (FlashMLA's FP8 rows, vLLM's fp8_ds_mla:
    # 656 B per token and layer for GLM-5 / DeepSeek-V3.2; cache/latent_format.py). Tiered or not.
    kv_cache_dtype: str = "auto"
    # Admission: "reserve" pages for prompt + max_tokens up front (an admitted request always runs to
    # its end, nothing is ever recomputed), or "optimistic": reserve the known tokens' pages plus one,
    # allocate as tokens come, and when the pages run out preempt the most recently admitted request
    # (its computed pages stay in the prefix cache; it is recomputed from them later), as vLLM does.
    kv_admission: str = "reserve"
    attention: str = "sparse"
    # A step's decodes run as one batch: selection, gather and attention (model/decode_plan.py); False:
    # one request at a time (the baseline `sparsekv bench batch` measures against).
    batch_dense_decodes: bool = True
    # Decode steps as pieces of fixed shapes per batch-size bucket (model/decode_graphs.py), up to
    # cuda_graph_max_bs requests: "auto" replays them from CUDA graphs on a CUDA device where they are
    # built (no data parallelism, untiered, DSA; elsewhere the engine's decode path); "off"; "eager": the
    # same pieces run uncaptured, on any device (what the graphs replay, for checking).
    decode_graphs: str = "auto"
    cuda_graph_max_bs: int = 64
    # Disk-tier prefix pages are read ahead of admission while the engine steps on (False: read at
    # admission, stalling the step; the baseline scripts/prefix_read_ahead.py measures against).
    prefix_cache_disk_read_ahead: bool = True
    seed: int = 0
    # In-process weight updates (docs/rl.md): keep this rank's slices of the tensors they gave in host
    # memory until the next update from disk, which later partial updates build from and a failed
    # update is put back from. False: keep none (a rank's host memory stays its model's, however
    # often a trainer updates it); a later partial update must then give every tensor those updates
    # replaced in the parts it touches, and a load that fails part-way where they replaced weights
    # cannot put them back (the engine stops serving, WeightRestoreError).
    weight_update_host_copy: bool = True
    tokenizer: str | None = None
    # The Hub revision (branch, tag or commit) of a `model` given as a repo id (hub.py); ignored for a directory.
    revision: str | None = None
    # torch intra-op threads. None: derived from the weights a decode token reads (threads.py), the
    # same for LLM() and the CLI; 0: torch's default.
    num_threads: int | None = None
    # Like vLLM's --hf-overrides: config.json fields replaced at load, e.g. {"index_topk_pattern": "FSSS"}
    # turns a checkpoint with an indexer in every layer into an IndexShare model (training-free IndexCache).
    hf_overrides: dict | None = field(default=None, hash=False)
    # Tiered KV cache (docs/tiers.md): a device working set of device_buffer_tokens latent slots per request and layer,
    # the full latent history in a host store (RAM, or a memory-mapped file: host_store_path is
    # a directory to make a fresh file in, or a new file name; an existing file is refused).
    kv_tiering: bool = False
    device_buffer_tokens: int | None = None    # default 2 x index_topk; must be >= index_topk
    host_kv_budget_bytes: int | None = None
    device_kv_budget_bytes: int | None = None  # also sizes the untiered cache when given
    host_store_path: str | None = None
    selector: str = "dsa"                      # token selector: 'dsa' (lightning indexer) or 'quest'
    quest_page_tokens: int = QUEST_PAGE_TOKENS
    indexer_key_dtype: str = "auto"            # 'auto' (the model dtype) or 'fp8_e4m3' (tiering only)
    # Speculative decoding with the checkpoint's MTP layer (speculative.py): draft tokens per step.
    num_speculative_tokens: int = 0
    # Reuse the full KV pages of earlier prompts with the same tokens, per tenant and cache_salt
    # (cache/prefix.py). On by default, as in vLLM and SGLang.
    enable_prefix_caching: bool = True
    # Host bytes for the prefix cache's evicted pages (cache/prefix_host.py); None = no host tier.
    prefix_cache_host_bytes: int | None = None
    # A directory for the prefix cache's disk tier (cache/prefix_disk.py), with its budget in bytes (whole
    # page files, over every namespace in the directory that no live engine holds): pages pushed out of
    # the host tier (or the pool, without one), kept across restarts.
    prefix_cache_disk_path: str | None = None
    prefix_cache_disk_bytes: int | None = None
    # The disk tier's pages are encrypted (AES-256-GCM) with a key derived from this file's secret (at
    # least 32 bytes); None: a key generated in the tier's directory and kept there (prefix_disk.py,
    # default_key_file).
    prefix_cache_disk_key_file: str | None = None
    # Key files being rotated out: pages sealed with them are still read, and re-sealed with the current
    # key in the background.
    prefix_cache_disk_old_key_files: list[str] | None = None
    # Plaintext pages on disk: anyone who can read the files can read the prompts back from them (the
    # latents of early layers depend on little more than the token), so this must be asked for.
    prefix_cache_disk_unencrypted: bool = False
    # Retention: a prefix-cache page no request has used for this many seconds is forgotten in every
    # tier (None: kept until evicted).
    prefix_cache_ttl_s: float | None = None
    # A tenant's cached (released, reusable) pool pages beyond this many are evicted, oldest first, to
    # the lower tiers if any: one tenant's traffic cannot fill the pool's cache (None: no bound).
    prefix_cache_max_pages_per_tenant: int | None = None
    # A tenant holds at most this fraction of each prefix-cache tier: the pool's pages, the host tier's
    # and the disk tier's budgets (None: no bound beyond prefix_cache_max_pages_per_tenant's).
    prefix_cache_tenant_share: float | None = None
    # A tenant's share of the KV cache's pages (None: none). With reserving admission a cap: its running
    # requests together reserve at most this fraction (prompt + max_tokens each), its other requests wait
    # while other tenants' are admitted. With optimistic admission a guarantee: it may hold more while no
    # one needs the pages; a tenant within its share that waits for pages preempts those over theirs.
    tenant_kv_share: float | None = None
    # Parallelism (parallel/, docs/parallel.md): ranks = tensor x data parallel, started and supervised
    # by the engine (torch.multiprocessing spawn) on this node; with nnodes > 1 the other nodes' ranks
    # join at dist_init_addr ("HOST:PORT"). A collective that waits longer than dist_timeout_s fails;
    # start-up (every rank joining, loading its shard and reporting) may take dist_startup_timeout_s.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout_s: float = 60.0
    dist_startup_timeout_s: float = 900.0

    def validate(self) -> None:
        _check_field_types(self)
        if self.dtype not in ("auto", *COMPUTE_DTYPES):
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use auto, {', '.join(COMPUTE_DTYPES)}")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(f"attention {self.attention!r} is not supported; use one of {ATTENTION_MODES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_page_size", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be an integer >= 0 (alternatives per token), got {self.max_logprobs}; "
                              f"-1 (the whole vocabulary, vLLM's no-cap) is not offered")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ConfigError(f"num_kv_pages must be >= 1, got {self.num_kv_pages}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 0):
            raise ConfigError(f"num_threads must be an integer >= 0 (0 = torch's default), got {self.num_threads!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 0 <= self.num_speculative_tokens <= 8:
            raise ConfigError(f"num_speculative_tokens must be an integer in [0, 8] (0 = off), "
                              f"got {self.num_speculative_tokens!r}")
        self._validate_device()
        self._validate_tiering()
        self._validate_parallel()
        self._validate_decode_graphs()

    def _validate_decode_graphs(self) -> None:
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ConfigError(f"decode_graphs {self.decode_graphs!r} is not supported; use one of {DECODE_GRAPH_MODES}")
        if not isinstance(self.cuda_graph_max_bs, int) or self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be an integer >= 1, got {self.cuda_graph_max_bs!r}")
        if self.decode_graphs == "eager" and self._decode_graphs_unbuilt():
            raise ConfigError(f"decode_graphs 'eager': the decode pieces are not built for "
                              f"{self._decode_graphs_unbuilt()}")

    def _decode_graphs_unbuilt(self) -> str | None:
        """What of this configuration the decode pieces are not built for (None: nothing)."""
        unbuilt = [name for name, unsupported in (
            ("attention 'dense'", self.attention != "sparse"),
            ("decodes one request at a time", not self.batch_dense_decodes)) if unsupported]
        return ", ".join(unbuilt) or None

    def decode_graph_mode(self) -> str:
        """How decode steps run: "capture" (CUDA graphs), "eager" (the same pieces uncaptured) or
        "off" (the engine's decode path)."""
        if self.decode_graphs == "off" or self._decode_graphs_unbuilt():
            return "off"
        if self.decode_graphs == "eager":
            return "eager"
        return "capture" if self.device.startswith("cuda") else "off"

    def _validate_device(self) -> None:
        check_device(self.device)

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        world = self.tensor_parallel_size * self.data_parallel_size
        if self.nnodes > 1 and (world % self.nnodes or self.dist_init_addr is None):
            raise ConfigError(f"nnodes {self.nnodes} needs dist_init_addr (HOST:PORT of node 0) and a world size "
                              f"(tensor_parallel_size x data_parallel_size = {world}) divisible by it")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise ConfigError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        for name in ("dist_timeout_s", "dist_startup_timeout_s"):
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:
                raise ConfigError(f"{name} must be in (0, {MAX_TIMEOUT_S}] seconds, got {getattr(self, name)!r}")
        if world > 1 and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"parallelism runs on cpu (gloo) or cuda (NCCL), not {self.device!r}")
        if world > 1 and self.device.startswith("cuda:"):  # rank r takes GPU r % count (parallel/executor.py)
            raise ConfigError(f"device {self.device!r} with {world} ranks: each rank takes its own GPU, so pass "
                              f"cuda and choose the GPUs with CUDA_VISIBLE_DEVICES")

    def _validate_disk_encryption(self) -> None:
        disk = self.prefix_cache_disk_path
        for name in ("prefix_cache_disk_key_file", "prefix_cache_disk_old_key_files", "prefix_cache_disk_unencrypted"):
            if getattr(self, name) and disk is None:
                raise ConfigError(f"{name} needs prefix_cache_disk_path")
        keys = self.prefix_cache_disk_key_file or self.prefix_cache_disk_old_key_files
        if self.prefix_cache_disk_unencrypted and keys:
            raise ConfigError("prefix_cache_disk_unencrypted contradicts prefix_cache_disk_key_file and "
                              "prefix_cache_disk_old_key_files (an unencrypted tier has no key)")

    def _validate_tiering(self) -> None:
        host = self.prefix_cache_host_bytes
        if host is not None and (host < 1 or not self.enable_prefix_caching):
            raise ConfigError(f"prefix_cache_host_bytes must be >= 1 and needs enable_prefix_caching, "
                              f"got {self.prefix_cache_host_bytes}")
        disk, disk_bytes = self.prefix_cache_disk_path, self.prefix_cache_disk_bytes
        if (disk is None) != (disk_bytes is None) or (disk is not None and not self.enable_prefix_caching):
            raise ConfigError("prefix_cache_disk_path and prefix_cache_disk_bytes go together and need "
                              f"enable_prefix_caching, got {disk!r} and {disk_bytes!r}")
        if disk_bytes is not None and disk_bytes < 1:
            raise ConfigError(f"prefix_cache_disk_bytes must be >= 1, got {disk_bytes}")
        self._validate_disk_encryption()
        quota = self.prefix_cache_max_pages_per_tenant
        if quota is not None and (quota < 0 or not self.enable_prefix_caching):
            raise ConfigError(f"prefix_cache_max_pages_per_tenant must be >= 0 and needs enable_prefix_caching, "
                              f"got {quota!r}")
        share = self.prefix_cache_tenant_share
        if share is not None and (not 0 < share <= 1 or not self.enable_prefix_caching):
            raise ConfigError(f"prefix_cache_tenant_share must be in (0, 1] and needs enable_prefix_caching, "
                              f"got {share!r}")
        if self.kv_admission not in ("reserve", "optimistic"):
            raise ConfigError(f"kv_admission must be 'reserve' or 'optimistic', got {self.kv_admission!r}")
        if self.tenant_kv_share is not None and not 0 < self.tenant_kv_share <= 1:
            raise ConfigError(f"tenant_kv_share must be in (0, 1], got {self.tenant_kv_share!r}")
        ttl = self.prefix_cache_ttl_s
        if ttl is not None and (not ttl > 0 or not self.enable_prefix_caching):
            raise ConfigError(f"prefix_cache_ttl_s must be > 0 and needs enable_prefix_caching, got {ttl!r}")
        for name in ("device_buffer_tokens", "host_kv_budget_bytes", "device_kv_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.selector not in SELECTORS:
            raise ConfigError(f"selector {self.selector!r} is not supported; use one of {SELECTORS}")
        if self.selector == "quest" and (self.quest_page_tokens < 1 or self.kv_page_size % self.quest_page_tokens):
            raise ConfigError(f"quest_page_tokens {self.quest_page_tokens} must divide kv_page_size {self.kv_page_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}")
        if self.indexer_key_dtype not in INDEXER_KEY_DTYPES:
            raise ConfigError(f"indexer_key_dtype {self.indexer_key_dtype!r} is not supported; use one of {INDEXER_KEY_DTYPES}")
        tier_only = {"device_buffer_tokens": self.device_buffer_tokens, "host_kv_budget_bytes": self.host_kv_budget_bytes,
                     "host_store_path": self.host_store_path,
                     "indexer_key_dtype": None if self.indexer_key_dtype == "auto" else self.indexer_key_dtype}
        given = [k for k, v in tier_only.items() if v is not None]
        if given and not self.kv_tiering:
            raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with kv_tiering=True")
        if self.kv_tiering and self.attention == "dense":
            raise ConfigError("kv_tiering needs attention='sparse': dense attention reads every position, "
                              "which a bounded working set cannot hold")
        if self.selector != "quest" and self.quest_page_tokens != QUEST_PAGE_TOKENS:
            raise ConfigError("quest_page_tokens only applies with selector='quest'")
        if self.selector == "quest" and self.attention == "dense":
            raise ConfigError("selector='quest' needs attention='sparse': dense attention selects nothing")
        if self.selector == "quest" and self.indexer_key_dtype != "auto" and not self.num_speculative_tokens:
            raise ConfigError("indexer_key_dtype applies to the lightning indexer's keys, which selector='quest' "
                              "keeps only for MTP drafting (num_speculative_tokens > 0)")
        if self.num_kv_pages is not None and self.device_kv_budget_bytes is not None and not self.kv_tiering:
            raise ConfigError("give num_kv_pages or device_kv_budget_bytes, not both")

    def validate_for_model(self, cfg: ModelConfig) -> None:
        """Checks that need the model: the working set must hold one step's top-k selection, and
        max_model_len stays within the positions the model was made for (as vLLM refuses it)."""
        n, index_topk = self.device_buffer_tokens, cfg.index_topk
        if self.kv_tiering and n is not None and n < index_topk:
            raise ConfigError(f"device_buffer_tokens ({n}) must be >= the model's index_topk ({index_topk}): "
                              f"one step attends to top-k positions, which must all fit in the working set")
        if self.max_model_len is not None and self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len ({self.max_model_len}) is beyond the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings}): positions past it are untrained; to run there "
                              f"anyway, raise that with hf_overrides '{{\"max_position_embeddings\": "
                              f"{self.max_model_len}}}'")


def check_device(device: str, name: str = "device") -> None:
    """A device this torch can use (cpu, cuda, cuda:N of a GPU it sees); ConfigError starting with
    `name` (the field, or the flag of a command that has no EngineConfig, as `sparsekv train`)."""
    import torch
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{name} must be cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name} {device!r}: this torch sees no CUDA device (a CPU build, or no GPU)")
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"{name} must be cpu, cuda or cuda:N, got {device!r}")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ConfigError(f"{name} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


_KINDS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "dict": (dict,), "list[str]": (list,)}


def _check_field_types(config) -> None:
    """Each option of a plain kind (a dataclass field annotated bool, int, float, str, dict or a list,
    or None where it may be) holds one: LLM(kv_tiering="false") would turn tiering on, a string count
    fail deep in the engine."""
    for f in dataclasses.fields(config):
        kinds = [k.strip() for k in str(f.type).split("|")]
        value = getattr(config, f.name)
        if value is None and "None" in kinds:
            continue
        allowed = [t for k in kinds for t in _KINDS.get(k, ())]
        if not allowed or len(allowed) < sum(k != "None" for k in kinds):
            continue  # a kind not checked here
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, tuple(allowed)):
            raise ConfigError(f"{f.name} must be {' or '.join(kinds)}, got {value!r}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{f.name} must be a list of strings, got {value!r}")


def _is_host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
