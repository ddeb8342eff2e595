"""Shared pieces of the evals: loading a checkpoint's parts, one-sequence forwards, held-out text."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..context import ForwardContext, SeqSlice

AUX_INDEXERS = os.path.join("indexshare", "indexers.safetensors")


def load_text_tokenizer(path: str):
    """The checkpoint's `tokenizers.Tokenizer` (the task generators work in its token space)."""
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{path}: no tokenizer.json; this eval tokenizes its texts with the model's "
                                f"tokenizer")
    return Tokenizer.from_file(file)


def heldout_stream(tok, max_tokens: int | None = None) -> list[int]:
    """Held-out stdlib code (the training split's complement), tokenized with the model's tokenizer."""
    from ..train.data import read_split, tokenize_stream
    _, heldout = read_split()
    eos = tok.token_to_id("<|endoftext|>")
    ids = tokenize_stream(tok, heldout, eos if eos is not None else 0).tolist()
    return ids[:max_tokens] if max_tokens else ids


def load_parts(path: str, dtype: torch.dtype = torch.float32):
    """(config, tensors) with the auxiliary indexers of shared layers merged in when present."""
    from safetensors.torch import load_file
    from ..model.checkpoint import load_tensors
    cfg = ModelConfig.from_json(path)
    tensors = load_tensors(path, cfg, dtype, torch.device("cpu"))
    aux = os.path.join(path, AUX_INDEXERS)
    if os.path.exists(aux):
        tensors.update({k: v.to(torch.float32 if k.endswith("weights_proj.weight") else dtype)
                        for k, v in load_file(aux).items()})
    return cfg, tensors


def layers_with_indexers(cfg: ModelConfig, tensors: dict) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if f"model.layers.{i}.self_attn.indexer.wk.weight" in tensors]


def build_model(cfg: ModelConfig, tensors: dict, dtype: torch.dtype = torch.float32):
    from ..model.model import DSAModel
    return DSAModel(cfg, tensors, dtype, torch.device("cpu"))


@torch.inference_mode()
def sequence_logits(model, ids: list[int], attention: str = "sparse", record=None,
                    page_size: int = 64) -> torch.Tensor:
    """fp32 logits [n, vocab] for every position of one sequence, through the engine's model."""
    from ..cache.pool import KVPool
    cfg = model.cfg
    n = len(ids)
    pages = -(-n // page_size)
    cache = KVPool(cfg, pages, page_size, model.dtype, model.device, list(range(cfg.num_hidden_layers)),
                   cfg.full_layers)
    slots = torch.arange(n)
    ctx = ForwardContext(torch.tensor(ids), torch.arange(n), slots, [SeqSlice("eval", 0, n, n, slots, runs=((0, 0, n),))],
                         torch.arange(n), attention, record_selection=record)
    return model.forward(ctx, cache)


def sequence_loss(model, ids: list[int], attention: str = "sparse", skip: int = 0) -> float:
    """Mean next-token loss over targets after the first `skip` positions."""
    logits = sequence_logits(model, ids, attention)
    targets = torch.tensor(ids[1:])
    return F.cross_entropy(logits[skip:-1], targets[skip:]).item()
