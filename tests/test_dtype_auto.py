"""`dtype="auto"`, the default as in vLLM: resolved once per process (hub.resolve_config) to the dtype
the engine computes in, from the checkpoint's config.json and the device."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from sparsekv.config import EngineConfig, ConfigError, auto_dtype, checkpoint_dtype
from sparsekv.hub import resolve_config
from test_server_util import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("named", ["float32", "bfloat16", "float16", None])
def test_auto_on_cpu_is_float32_whatever_the_checkpoint_names(named):
    assert auto_dtype(named, "cpu") == "float32"


@pytest.mark.parametrize("named, bf16, picked", [
    ("bfloat16", True, "bfloat16"), ("float16", True, "float16"), ("float32", True, "bfloat16"), (None, True, "bfloat16"),
    ("float8_e4m3fn", True, "bfloat16"),
    ("bfloat16", False, "float16"), ("float32", False, "float16"), ("float16", False, "float16")])
def test_auto_on_cuda_is_the_checkpoints_16_bit_dtype_else_bfloat16(named, bf16, picked):
    assert auto_dtype(named, "cuda", bf16) == picked


def _with_config(checkpoint: str, path, **fields) -> str:
    """A copy of `checkpoint` whose config.json has `fields` set (None: removed)."""
    out = str(path)
    shutil.copytree(checkpoint, out)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    for name, value in fields.items():
        raw.pop(name, None) if value is None else raw.__setitem__(name, value)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return out


def test_checkpoint_dtype_reads_dtype_then_torch_dtype(checkpoint, tmp_path):
    assert checkpoint_dtype(_with_config(checkpoint, tmp_path / "a", dtype="bfloat16")) == "bfloat16"
    assert checkpoint_dtype(_with_config(checkpoint, tmp_path / "b", dtype=None, torch_dtype="float16")) == "float16"
    assert checkpoint_dtype(_with_config(checkpoint, tmp_path / "c", dtype=None, torch_dtype="torch.float16")) == "float16"
    assert checkpoint_dtype(_with_config(checkpoint, tmp_path / "d", dtype=None, torch_dtype=None)) is None
    assert checkpoint_dtype(str(tmp_path / "missing")) is None


def test_resolve_config_turns_auto_into_a_compute_dtype_and_keeps_an_explicit_one(checkpoint, tmp_path):
    bf16_checkpoint = _with_config(checkpoint, tmp_path / "bf16", dtype="bfloat16")
    resolved = resolve_config(EngineConfig(model=bf16_checkpoint))
    assert EngineConfig(model=bf16_checkpoint).dtype == "auto" and resolved.dtype == "float32"  # on CPU
    explicit = EngineConfig(model=bf16_checkpoint, dtype="bfloat16")
    assert resolve_config(explicit) is explicit


def test_an_engine_by_default_computes_in_float32_on_cpu(checkpoint):
    from sparsekv import LLM
    llm = LLM(checkpoint, max_model_len=64, kv_page_size=16, max_num_seqs=1)
    assert llm.engine.config.dtype == "float32" and llm.engine.dtype == torch.float32
    assert llm.engine.model.embed.dtype == torch.float32


def test_an_unknown_dtype_names_auto_among_the_choices(checkpoint):
    with pytest.raises(ConfigError, match="use auto, float32, bfloat16, float16"):
        EngineConfig(model=checkpoint, dtype="fp64").validate()


def test_the_cli_defaults_to_auto_and_accepts_it(checkpoint, capsys):
    from sparsekv.__main__ import main
    from sparsekv.cli import generate_parser
    args = generate_parser().parse_args([checkpoint, "--prompt-token-ids", "1"])
    assert args.dtype == "auto"
    assert main(["generate", checkpoint, "--dtype", "auto", "--prompt-token-ids", "1,2", "--max-tokens", "2"]) == 0


def test_a_torchrun_rank_resolves_auto_as_rank_0s_engine_does(checkpoint, monkeypatch):
    """Each process resolves its own options: rank 0's engine, and the other ranks before they compare
    theirs with rank 0's (launch_fingerprint), which an unresolved "auto" would fail."""
    from sparsekv.parallel import lanes
    seen = []
    monkeypatch.setattr(lanes, "torchrun_rank", lambda config: 1)
    monkeypatch.setattr(lanes, "check_layout", lambda config: None)
    monkeypatch.setattr(lanes, "serve_rank", lambda config, rank, addr: seen.append(config))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert lanes.host_torchrun_rank(EngineConfig(model=checkpoint, tensor_parallel_size=2))
    assert [c.dtype for c in seen] == ["float32"]


def test_another_node_resolves_auto_as_node_0s_engine_does(checkpoint, monkeypatch):
    from types import SimpleNamespace
    from sparsekv.parallel import lanes
    seen = []
    monkeypatch.setattr(lanes, "check_layout", lambda config: None)
    monkeypatch.setattr(lanes, "RankGroup", SimpleNamespace(
        start=lambda config, target: seen.append(config) or SimpleNamespace(processes=[])))
    monkeypatch.setattr(lanes, "_stop_ranks_on_sigterm", lambda processes: [])
    config = EngineConfig(model=checkpoint, tensor_parallel_size=2, nnodes=2, node_rank=1,
                          dist_init_addr="127.0.0.1:1")
    assert lanes.host_node(config) == 0
    assert [c.dtype for c in seen] == ["float32"]


@pytest.mark.parametrize("bf16, picked", [(True, "bfloat16"), (False, "float16")])
def test_resolve_config_on_a_gpu_asks_whether_it_has_bfloat16(checkpoint, tmp_path, monkeypatch, bf16, picked):
    """On CUDA, "auto" is the checkpoint's bfloat16 only on a GPU that has it (float16 on one that does
    not, as a V100 or T4). No GPU here: torch is told what the GPU supports; the config is not validated."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    bf16_checkpoint = _with_config(checkpoint, tmp_path / "bf16", dtype="bfloat16")
    assert resolve_config(EngineConfig(model=bf16_checkpoint, device="cuda")).dtype == picked
