"""Models by Hugging Face repo id: `sparsekv serve ORG/NAME`, `LLM("org/name", revision=...)`.

`resolve_model` turns what the user gave into a checkpoint directory, in this order:

  1. a local directory of that name (it wins over a repo id of the same spelling);
  2. the local Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub):
     the snapshot that `refs/<revision>` names, or the snapshot of a commit hash;
  3. a download with `snapshot_download`, of the files the engine reads only (`MODEL_FILES`), unless
     `HF_HUB_OFFLINE=1`.

The cache layout, refs and downloads are huggingface_hub's own (`snapshot_download`, first with
`local_files_only`). A name that is neither a directory nor `ORG/NAME` is returned as given, so the
checkpoint loader reports the missing config.json; an `ORG/NAME` found nowhere is `ModelNotFound`,
naming every place searched. A `revision` applies to repo ids only.
"""
from __future__ import annotations

import dataclasses
import os

from .config import ConfigError, auto_dtype, checkpoint_dtype
from .error_text import first_line

# config, weights (sharded or not), tokenizer and chat template: what a checkpoint directory needs
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "*.tiktoken", "chat_template.jinja",
                   "chat_template.json"]
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               *TOKENIZER_FILES]


class ModelNotFound(ConfigError):
    """A repo id found neither as a directory, nor in the local cache, nor on the Hub."""


def is_repo_id(name: str) -> bool:
    """`ORG/NAME` as the Hub spells repo ids (a bare `NAME` is taken for a directory, not looked up)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(name: str, revision: str | None = None, cache_dir: str | None = None,
                  allow_patterns: list[str] = MODEL_FILES) -> str:
    """The checkpoint directory for `name`: a local directory, or a repo id's snapshot (module docstring)."""
    if os.path.isdir(name) or not is_repo_id(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    cache_dir = cache_dir or constants.HF_HUB_CACHE
    searched = [f"no directory {os.path.abspath(name)}",
                f"not in the Hugging Face cache {cache_dir} at revision {revision or 'main'}"]
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns,
                                 local_files_only=True)
    except LocalEntryNotFoundError:  # includes a cached snapshot with files missing
        pass
    if constants.is_offline_mode():
        searched.append("not downloaded: HF_HUB_OFFLINE is set")
        raise ModelNotFound(_not_found(name, searched))
    return _download(name, revision, cache_dir, allow_patterns, searched)


def _download(name: str, revision: str | None, cache_dir: str, allow_patterns: list[str], searched: list) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        path = snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        searched.append(f"not downloaded from {constants.ENDPOINT} ({type(e).__name__}: {first_line(e)})")
        raise ModelNotFound(_not_found(name, searched)) from None
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelNotFound(f"model {name!r}: the Hub snapshot {path} has no config.json")
    return path


def _not_found(name: str, searched: list[str]) -> str:
    return f"model {name!r} not found: " + "; ".join(searched)


def resolve_config(config):
    """`config` with `model` (and a `tokenizer` given as a repo id) resolved to local directories and
    dtype "auto" to the one it computes in (config.auto_dtype); the same object when there is nothing
    to resolve. Every process of an engine resolves its own options so (each node parses its flags)."""
    model = resolve_model(config.model, config.revision)
    tokenizer = config.tokenizer and resolve_model(config.tokenizer, None, allow_patterns=TOKENIZER_FILES)
    dtype = config.dtype if config.dtype != "auto" else _auto_dtype(model, config.device)
    if (model, tokenizer, dtype) == (config.model, config.tokenizer, config.dtype):
        return config
    return dataclasses.replace(config, model=model, tokenizer=tokenizer, dtype=dtype)


def _auto_dtype(model: str, device: str) -> str:
    import torch
    device_type = torch.device(device).type
    bf16 = device_type != "cuda" or torch.cuda.is_bf16_supported()
    return auto_dtype(checkpoint_dtype(model), device_type, bf16)
