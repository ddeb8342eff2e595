"""Write a Hugging Face checkpoint directory from the training model.

config.json (model_type glm_moe_dsa, explicit indexer_types, num_nextn_predict_layers 1),
model.safetensors (per-expert tensor names as transformers saves them; the MTP layer as
model.layers.{num_hidden_layers}.*), tokenizer.json and tokenizer_config.json.
"""
from __future__ import annotations

import json
import os
import platform

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .tokenizer import save_tokenizer


def hf_config(arch: dict, vocab_size: int, eos_id: int) -> dict:
    """The config.json dict. `arch` holds the size fields (see cli.PRESETS)."""
    n = arch["num_hidden_layers"]
    pattern = arch["index_topk_pattern"]
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        **{k: v for k, v in arch.items() if k != "index_topk_pattern"},
        "vocab_size": vocab_size,
        "num_key_value_heads": arch["num_attention_heads"],
        "indexer_types": ["full" if c == "F" else "shared" for c in pattern[:n]],
        "mlp_layer_types": ["dense"] * arch["first_k_dense_replace"] + ["sparse"] * (n - arch["first_k_dense_replace"]),
        "indexer_rope_interleave": True,
        "num_nextn_predict_layers": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "bos_token_id": None,
        "dtype": "float32",   # compute dtype the tools default to; tensors may be stored in bf16
    }


def model_config(raw: dict) -> ModelConfig:
    return ModelConfig.from_dict(raw, where="training config")


KEEP_FP32 = ("e_score_correction_bias", "weights_proj.weight")   # fp32 in the reference


def checkpoint_tensors(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().to(torch.float32 if name.endswith(KEEP_FP32) else dtype).contiguous().clone()
            for name, t in model.state_dict().items()}


AUX_INDEXERS = os.path.join("indexshare", "indexers.safetensors")


def export(model, raw_config: dict, tok, out_dir: str, extra: dict | None = None,
           dtype: torch.dtype = torch.float32) -> None:
    """The auxiliary indexers of shared layers go to indexshare/indexers.safetensors (same tensor
    names), outside the checkpoint proper, for `sparsekv eval indexshare`. `dtype` is the storage
    dtype (bf16 halves the bundled model; the engine and transformers upcast exactly)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = checkpoint_tensors(model, dtype)
    aux = {n: tensors.pop(n) for n in model.aux_indexer_names()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if aux:
        os.makedirs(os.path.join(out_dir, "indexshare"), exist_ok=True)
        save_file(aux, os.path.join(out_dir, AUX_INDEXERS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw_config, f, indent=2)
    save_tokenizer(tok, out_dir)
    if extra is not None:
        with open(os.path.join(out_dir, "training.json"), "w") as f:
            json.dump(extra, f, indent=2)


def machine_fingerprint() -> dict:
    """What fixes the float rounding of a CPU run: the CPU model and the kernels torch picks for it.
    Training records it (training.json's "machine") because two machines can give different weights
    from the same seed and code (docs/training.md, "Reproducibility"). Here, not in tools/hardware.py
    (the planner's profiles), which only the tools may import (tests/test_imports.py)."""
    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break   # the first processor is enough
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "cpu family", "model", "stepping"):
                    cpu[key.strip()] = value.strip()
    except OSError:
        pass
    return {"cpu": cpu or platform.processor(), "arch": platform.machine(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl": torch.backends.mkl.is_available(),
            "threads": torch.get_num_threads()}
