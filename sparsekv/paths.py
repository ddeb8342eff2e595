"""Where the bundled default model lives."""
from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "models", "sparsekv-tiny")


def default_model_path() -> str:
    path = os.environ.get("SPARSEKV_MODEL", DEFAULT_MODEL_DIR)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"default model not found at {path}; create it with `sparsekv make-tiny-model`")
    return path
