"""Where the bundled default model lives."""
from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "models", "sparsekv-tiny")
MODEL_ENV = "SPARSEKV_MODEL"


def default_model_path() -> str:
    path = os.environ.get(MODEL_ENV, DEFAULT_MODEL_DIR)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(missing_default_model(path, from_env=MODEL_ENV in os.environ))
    return path


def missing_default_model(path: str, from_env: bool) -> str:
    """What to do when the default model has no config.json. The bundled model is trained (with its
    tokenizer) and ships with the repository; `make-tiny-model` writes random weights, no tokenizer."""
    if from_env:
        return (f"{MODEL_ENV}={path}: no config.json there; point it at a checkpoint directory, or write "
                f"random weights (no tokenizer) there with `sparsekv make-tiny-model {path}`")
    return (f"the bundled model is missing: no config.json at {path} (it ships with the repository; "
            f"docs/bundled_model.md); give a checkpoint directory as MODEL or in {MODEL_ENV}, or write "
            f"random weights (no tokenizer) with `sparsekv make-tiny-model DIR`")
