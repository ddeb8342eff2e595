"""Shared fixtures: tiny random checkpoints built with transformers, and a parity helper."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # tiny models gain nothing from more; a busy second core would stall ops

# Multi-rank engines and commands in tests start with this start-up timeout: a start-up that hangs (a
# rank that never joins) fails its test within it, not at the 900 s default; a rank of the tiny models
# here starts in seconds.
STARTUP_S = 120.0
STARTUP_FLAGS = ["--dist-startup-timeout", str(STARTUP_S)]


def reference_logprobs(ref_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of a full transformers forward over the whole sequence: [len, vocab]."""
    with torch.no_grad():
        logits = ref_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def assert_matches_reference(ref_model, prompt: list[int], out, atol: float | None = None) -> float:
    """Greedy tokens identical and every generated token's logprob within atol of transformers.

    The two compute the same function with other formulas (MLA absorbed or not, other matmul shapes),
    so they round differently: atol defaults to the bound derived from the model (tests/tolerances.py),
    and the reference's top-1 must lead by more than 2 atol wherever tokens are compared."""
    from tolerances import logprob_tolerance
    atol = logprob_tolerance(ref_model) if atol is None else atol
    seq = prompt + out.token_ids
    lp = reference_logprobs(ref_model, seq)
    start = len(prompt) - 1
    ref_tokens = lp[start:start + len(out.token_ids)].argmax(-1).tolist()
    lead = lp[start:start + len(out.token_ids)].topk(2, dim=-1).values
    lead = (lead[:, 0] - lead[:, 1]).min().item()
    assert lead > 2 * atol, f"not a robust test input: a reference top-1 leads by {lead:.3g}, within 2 x {atol:.3g}"
    assert out.token_ids == ref_tokens, f"greedy tokens differ: {out.token_ids} vs reference {ref_tokens}"
    worst = 0.0
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        for t, v in d.items():
            worst = max(worst, abs(v - lp[start + i, t].item()))
    assert worst <= atol, f"logprob error {worst} > {atol}"
    return worst


@pytest.fixture(scope="session")
def glm_ckpt(tmp_path_factory):
    from sparsekv.tools.tiny import save_reference_checkpoint
    path = str(tmp_path_factory.mktemp("glm"))
    model = save_reference_checkpoint(path, "glm_moe_dsa")
    return path, model


@pytest.fixture(scope="session")
def ds_ckpt(tmp_path_factory):
    from sparsekv.tools.tiny import save_reference_checkpoint
    path = str(tmp_path_factory.mktemp("ds"))
    model = save_reference_checkpoint(
        path, "deepseek_v32", n_group=2, topk_group=1, n_routed_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    return path, model


@pytest.fixture
def random_prompt():
    def make(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (n,), generator=g).tolist()
    return make


@pytest.fixture
def serve_never_listens(monkeypatch):
    """For tests of options `sparsekv serve` must refuse: it must stop before it binds its port, since an
    option that got through would otherwise serve on the default port until the test's timeout."""
    def listening_socket(host, port):
        raise AssertionError(f"serve went on to listen on {host}:{port}")
    monkeypatch.setattr("sparsekv.server.cli.listening_socket", listening_socket)


@pytest.fixture
def emulated_cuda(monkeypatch):
    """CUDA's configuration on this CPU: batched decode selection, query-major decode scores, and the
    tier link's copies landing as late as CUDA's stream ordering allows (HostLink.emulate_async:
    backups at flush(), shared layers' fetched rows at wait(layer)). Returns how many deferred
    backups and fetches landed, so a test can check that the emulation really ran."""
    from sparsekv.cache.host_store import HostLink
    from sparsekv.model import indexer
    from sparsekv.model.selectors import DSASelector
    monkeypatch.setattr(HostLink, "emulate_async", True)
    monkeypatch.setattr(DSASelector, "batch_decode", True)
    monkeypatch.setattr(indexer, "DECODE_KEYS_MAJOR_MIN_KEYS_CPU", indexer.DECODE_KEYS_MAJOR_MIN_KEYS_GPU)
    landed = {"backups": 0, "fetches": 0}
    real_flush, real_wait = HostLink.flush, HostLink.wait

    def flush(self):
        landed["backups"] += len(self._pending)
        real_flush(self)

    def wait(self, layer):
        landed["fetches"] += len(self._landing.get(layer, ()))
        real_wait(self, layer)
    monkeypatch.setattr(HostLink, "flush", flush)
    monkeypatch.setattr(HostLink, "wait", wait)
    return landed
