"""Decodes below top-k context (DSA's dense regime) run as one batch per padded length
(`MLAttention._attend_dense_decodes`): the same greedy tokens as one request at a time, logprobs
within the rounding bound of regrouped rows (tests/tolerances.py), on the device pool, the tiered
cache and with drafts."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.model.attention import dense_length
from sparsekv.tools.tiny import save_reference_checkpoint
from tolerances import assert_same_greedy, logprob_tolerance

TOPK = 32
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
# 3 to 30 tokens: some cross top-k (32) while decoding, from the dense path to the sparse one
PROMPTS = [[(7 * i + j) % 250 + 1 for i in range(n)] for j, n in enumerate((3, 9, 17, 30, 12))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dense-decode"))
    save_reference_checkpoint(path, family="glm_moe_dsa", seed=3, index_topk=TOPK)
    return path


def run(path, prompts, params=GREEDY, **options):
    torch.set_num_threads(1)
    llm = LLM(path, kv_page_size=16, max_num_seqs=8, enable_prefix_caching=False, **options)
    calls = []
    original = llm.engine.kv.pool.dense_decode_latents
    llm.engine.kv.pool.dense_decode_latents = lambda *a: calls.append(len(a[1])) or original(*a)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return outs, calls


def tolerance(path) -> float:
    """Batched and one at a time group the rows of every matrix product differently."""
    return logprob_tolerance(LLM(path, max_model_len=64, enable_prefix_caching=False))


def test_dense_length_is_a_power_of_two_within_top_k():
    assert [dense_length(n, 256) for n in (1, 16, 17, 100, 128, 129, 256)] == [16, 16, 32, 128, 128, 256, 256]
    assert dense_length(200, 200) == 200  # never past top-k, even when it is not a power of two


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=TOPK)], ids=["device", "tiered"])
def test_batched_dense_decodes_equal_one_request_at_a_time(ckpt, options, request):
    got, calls = run(ckpt, PROMPTS, **options)
    assert max(calls) > 1  # several requests per batch went through the batched path
    want, none = run(ckpt, PROMPTS, batch_dense_decodes=False, **options)  # one request at a time
    assert none == []
    assert_same_greedy(want, got, tolerance(ckpt))


def test_drafted_dense_decodes_equal_one_request_at_a_time(request):
    """With MTP drafts each request's 1 + k rows share its padded history (the bundled model: top-k
    256, so these prompts decode in the dense regime throughout)."""
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
    got, calls = run(None, prompts, num_speculative_tokens=2)
    assert calls
    want, _ = run(None, prompts, num_speculative_tokens=2, batch_dense_decodes=False)
    assert_same_greedy(want, got, tolerance(None))


def test_bench_batch_runs_both_paths_and_checks_they_agree(tmp_path, capsys):
    import json

    from sparsekv.tools.bench import main
    out = tmp_path / "batch.json"
    assert main(["batch", "--batch", "4", "--prompt-tokens", "40", "--steps", "6", "--repeats", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"one request at a time", "batched"}
    assert result["identical_tokens"] and result["max_logprob_diff"] <= tolerance(None)  # the bundled model
    assert main(["batch", "--prompt-tokens", "250", "--steps", "32"]) == 2  # past top-k (256): refused
    assert "top-k" in capsys.readouterr().err
    assert main(["batch", "--sparse-prompt-tokens", "256"]) == 2  # a "sparse" run that never selects: refused
    assert "--sparse-prompt-tokens must be past top-k (256)" in capsys.readouterr().err


def test_bench_batch_refuses_a_dense_run_past_top_k_by_a_few_tokens(capsys):
    """The refusal is exact: 250 prompt tokens + 7 steps on the bundled model (top-k 256)."""
    from sparsekv.tools.bench import main
    assert main(["batch", "--batch", "1", "--prompt-tokens", "250", "--steps", "7", "--repeats", "1"]) == 2
    assert "top-k" in capsys.readouterr().err


MIXED = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=2, ignore_eos=True, top_p=0.9, top_k=50),
         SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, logprobs=1, ignore_eos=True)]


def test_plain_rows_decided_together_equal_one_row_at_a_time(ckpt, monkeypatch):
    """`OutputProcessor._decide_plain_rows`: plain rows, greedy and sampled (seeded, each with its own generator),
    take one argmax, one filter and softmax, one log_softmax for the batch; a penalised row and rows
    without logprobs mixed in. The same tokens and logprob dicts, bit for bit, as deciding each row
    alone: the model's logits are the same, and each of these reduces over one row's vocabulary,
    which a row-wise kernel does the same way whatever the number of rows."""
    from sparsekv.output_processor import OutputProcessor
    params = MIXED
    batched_rows = []
    original = OutputProcessor._decide_plain_rows

    def spy(self, chunks, logits):
        decided = original(self, chunks, logits)
        batched_rows.append(len(decided))
        return decided
    monkeypatch.setattr(OutputProcessor, "_decide_plain_rows", spy)
    llm = LLM(ckpt, kv_page_size=16, max_num_seqs=8, enable_prefix_caching=False)
    got = llm.generate(PROMPTS, params)
    assert max(batched_rows) == 4  # the plain requests, greedy and sampled; never the penalised one
    monkeypatch.setattr(OutputProcessor, "_decide_plain_rows", lambda self, chunks, logits: {})  # every row
    # through `_rows_on_host`, gathered from the step's logits (several requests' rows: one index)
    want = llm.generate(PROMPTS, params)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and (a.logprobs is None or
                                            [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs])
    llm.engine.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=TOPK)], ids=["device", "tiered"])
def test_batched_dense_decodes_on_cuda(ckpt, options, request):
    got, calls = run(ckpt, PROMPTS, device="cuda", dtype="float32", **options)  # the tolerance is float32's
    assert max(calls) > 1
    want, _ = run(ckpt, PROMPTS, device="cuda", dtype="float32", batch_dense_decodes=False, **options)
    assert_same_greedy(want, got, tolerance(ckpt))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
def test_rows_decided_on_the_device_and_on_the_host_agree_with_the_cpu_on_cuda(ckpt):
    """On a device the plain rows are decided where the model computed them and only the other rows
    (the penalised ones here, two: gathered by one index) cross to the host
    (`OutputProcessor._rows_on_host`): the greedy requests, plain and penalised, give the CPU engine's
    tokens, logprobs within float32's tolerance; the seeded one samples beside them."""
    penalised = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True, repetition_penalty=1.3)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=5, top_p=0.9, ignore_eos=True)
    params = [GREEDY, GREEDY, penalised, penalised, seeded]
    options = dict(dtype="float32", kv_page_size=16, max_num_seqs=8, enable_prefix_caching=False)
    want = LLM(ckpt, **options).generate(PROMPTS, params)
    llm = LLM(ckpt, device="cuda", **options)
    got = llm.generate(PROMPTS, params)
    llm.engine.check_integrity()
    assert_same_greedy(want[:2], got[:2], tolerance(ckpt))
    assert_same_greedy(want[2:4], got[2:4], tolerance(ckpt), lead=False)  # raw logprobs, penalties decided
    assert len(got[4].token_ids) == 24


def test_bench_batch_times_only_dense_regime_steps(capsys, monkeypatch):
    """`sparsekv bench batch --prompt-tokens P --steps S`: its last timed step attends to P + S + 1
    entries (the prompt, the prefill's token, the counted step's and the S timed steps'), so the dense
    regime it measures needs P + S < top-k (256 on the bundled model): P + S = 256 is refused (its last
    timed step went the sparse path, past top-k), and with P + S = 255 no step of either path does."""
    from sparsekv.model.attention import MLAttention
    from sparsekv.tools.bench import main
    sparse, real = [], MLAttention._sparse
    monkeypatch.setattr(MLAttention, "_sparse", lambda self, seq, ctx: sparse.append(real(self, seq, ctx)) or sparse[-1])
    assert main(["batch", "--batch", "1", "--prompt-tokens", "250", "--steps", "6", "--repeats", "1"]) == 2
    assert "top-k" in capsys.readouterr().err
    sparse.clear()
    assert main(["batch", "--batch", "1", "--prompt-tokens", "249", "--steps", "6", "--repeats", "1"]) == 0
    assert sparse and not any(sparse)
