"""FP8 latents (`kv_cache_dtype="fp8"`, FlashMLA's 656-byte rows): the format, exactness of tiering,
prefix-cache hits and speculative decoding with it, the capacity it buys, and how far it moves outputs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.cache.latent_format import E4M3_MAX, FP8Latent, PlainLatent
from sparsekv.paths import default_model_path
from test_tiers import (GREEDY, PROMPTS, SMALL, TOPK, assert_back_to_initial, assert_same, generate,
                        tiny_checkpoints)
from tolerances import U32, e4m3_error

FP8 = dict(kv_cache_dtype="fp8")
# kv_lora_rank 32 in one tile + 1 fp32 scale + rope 8 in bf16, 4 layers; fp32 latents: (32 + 8) x 4 B
FP8_LATENT_BYTES_PER_TOKEN, FP32_LATENT_BYTES_PER_TOKEN = (32 + 4 + 8 * 2) * 4, (32 + 8) * 4 * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("kv-dtype"))


def test_fp8_rows_have_flashmla_layout_and_round_trip():
    glm5 = FP8Latent(SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64), torch.bfloat16)
    assert (glm5.row_bytes, glm5.tiles, glm5.tile) == (656, 4, 128)  # 512 e4m3 + 4 fp32 scales + 64 bf16
    assert PlainLatent(SimpleNamespace(latent_dim=576), torch.bfloat16).row_bytes == 1152
    fmt = FP8Latent(SimpleNamespace(kv_lora_rank=256, qk_rope_head_dim=16), torch.float32)
    assert fmt.tiles == 2 and fmt.row_bytes == 256 + 8 + 32
    g = torch.Generator().manual_seed(0)
    values = torch.randn(64, 272, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows of every magnitude
    values[5, :128] = 0.0  # an all-zero tile decodes to zeros, not NaN
    rows = fmt.encode(values)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 296)
    back = fmt.decode(rows)
    nope, got = values[:, :256].view(64, 2, 128), back[:, :256].view(64, 2, 128)
    scale = nope.abs().amax(-1, keepdim=True) / E4M3_MAX  # the encoder's (an all-zero tile: 0 here, no error)
    # half an e4m3 step (3 mantissa bits; subnormals below 2^-6 of the scale) and float32's roundings
    assert ((got - nope).abs() <= e4m3_error(nope, scale)).all()
    # the tile's largest is kept: 448 * fl(amax / 448), two float32 roundings of amax
    assert (got.abs().amax(-1) <= nope.abs().amax(-1).double() * (1 + U32) ** 2).all()
    assert torch.equal(back[5, :128], torch.zeros(128))
    assert torch.equal(back[:, 256:], values[:, 256:].to(torch.bfloat16).float())  # k_R in bf16
    assert torch.equal(fmt.decode(rows.view(8, 8, -1)), back.view(8, 8, -1))          # any leading shape


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("selector", ["dsa", "quest"])
def test_fp8_cache_is_exact_under_tiering_and_prefix_hits(ckpt, family, selector):
    """With FP8 latents, tiering (N = top-k and 2 x top-k) gives bit-identical tokens and logprobs to
    FP8 without it: every read sees the same rows. So do prefix-cache hits on pages computed in the
    same row groups (one prompt at a time, chunks of one page). Pages computed in other groups (a
    batch) would hold latents a rounding apart, and one that straddles an e4m3 rounding step lands a
    whole step away, which moves logprobs by far more than rounding (see the speculative test below)."""
    reference, llm = generate(ckpt[family], selector=selector, enable_prefix_caching=False, **FP8)
    assert llm.engine.kv.pool.latent_bytes_per_token() == FP8_LATENT_BYTES_PER_TOKEN
    for n in (TOPK, None):
        outs, tiered = generate(ckpt[family], selector=selector, kv_tiering=True, device_buffer_tokens=n, **FP8)
        assert_same(reference, outs)
        assert tiered.stats()["tier_misses"] > 0
        assert tiered.stats()["host_kv_bytes"] == 0 and tiered.engine.kv.pool.host.row_bytes * 4 == \
            FP8_LATENT_BYTES_PER_TOKEN
    # one prompt at a time, also when the cache is filled, so every page is computed in the same rows
    alone = LLM(ckpt[family], selector=selector, enable_prefix_caching=False, **SMALL, **FP8)
    want = [alone.generate([p], GREEDY)[0] for p in PROMPTS]
    cached = LLM(ckpt[family], selector=selector, **SMALL, **FP8)
    for p in PROMPTS:
        cached.generate([p], GREEDY)
    again = [cached.generate([p], GREEDY)[0] for p in PROMPTS]  # every full page of every prompt is a hit now
    assert [o.num_cached_tokens for o in again] == [32, 0, 16, 48]
    assert_same(want, again)
    assert_back_to_initial(cached.engine)


def test_fp8_cache_is_exact_under_emulated_cuda_ordering(ckpt, emulated_cuda):
    reference, _ = generate(ckpt["glm_moe_dsa"], **FP8)
    outs, _ = generate(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK, **FP8)
    assert_same(reference, outs)
    assert emulated_cuda["fetches"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_rows_and_tiering_on_cuda(ckpt):
    """CUDA encodes the same bytes and decodes them natively to what the CPU's table gives; tiering
    stays exact with FP8 rows on the device (scripts/gpu_check.py runs this)."""
    fmt = FP8Latent(SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64), torch.float32)
    values = torch.randn(256, 576, generator=torch.Generator().manual_seed(0))
    rows = fmt.encode(values)
    assert torch.equal(fmt.encode(values.cuda()).cpu(), rows)
    assert torch.equal(fmt.decode(rows.cuda()).cpu(), fmt.decode(rows))
    reference, _ = generate(ckpt["glm_moe_dsa"], device="cuda", **FP8)
    outs, llm = generate(ckpt["glm_moe_dsa"], device="cuda", kv_tiering=True, device_buffer_tokens=TOPK, **FP8)
    assert_same(reference, outs)
    assert llm.stats()["tier_misses"] > 0


def _storing(monkeypatch, replay: dict | None = None) -> dict:
    """Record every latent row the layers store, by (request, layer, position), the last write winning
    (a rejected draft's row is overwritten by the token that replaced it). With `replay`, the rows
    stored are replay's wherever it has one."""
    from sparsekv.model.attention import MLAttention
    stored = {}
    forward = getattr(MLAttention.forward, "unpatched", MLAttention.forward)  # not an earlier spy

    def spy(self, x, ctx, cache):
        if ctx.draft_step:  # draft steps 2..K store nothing
            return forward(self, x, ctx, cache)
        keys = [None] * ctx.num_tokens
        for seq in ctx.seqs:
            for r in range(seq.token_start, seq.token_end):
                keys[r] = (seq.request_id, self.layer_idx, int(ctx.positions[r]))
        fmt, encode = cache.fmt, cache.fmt.encode

        def substitute(values):
            rows = encode(values)
            for i, key in enumerate(keys):
                if replay is not None and key in replay:
                    rows[i] = replay[key]
                stored[key] = rows[i].clone()
            return rows
        fmt.encode = substitute
        try:
            return forward(self, x, ctx, cache)
        finally:
            del fmt.encode
    spy.unpatched = forward
    monkeypatch.setattr(MLAttention, "forward", spy)
    return stored


def test_fp8_cache_with_speculative_decoding_equals_plain_greedy(monkeypatch):
    """The bundled model's MTP drafts verified against FP8 latents: what FP8 decoding without drafts
    gives. The two runs compute each latent in other row groups (a verification step's 1 + K rows, a
    decode's 1 row), so a latent comes out a rounding apart, and where it straddles a rounding step
    of e4m3 (or of k_R's bf16) it is stored a whole step away: one such flip can move a logprob by
    ~1e-2, and which latents straddle depends on the CPU's kernels. So: (1) the rows the two runs store
    agree up to such flips, element by element (a row encoded with another row's scale, or a stale
    row, would not), and (2) plain decoding that stores the drafting run's rows instead of its own
    (the same cache contents) gives the drafting run's tokens, logprobs within the rounding bound."""
    from tolerances import EPS32, LAMBDA, assert_same_greedy, logprob_tolerance, reduction_length
    prompts = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n    parser = "]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    options = dict(max_model_len=512, prefill_chunk_tokens=8, max_num_batched_tokens=20, **FP8)
    drafting = _storing(monkeypatch)
    llm = LLM(default_model_path(), num_speculative_tokens=2, **options)
    spec = llm.generate(prompts, params)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    llm.engine.check_integrity()
    own = _storing(monkeypatch)
    plain = LLM(default_model_path(), **options)
    plain.generate(prompts, params)
    cfg, fmt = plain.engine.model.cfg, plain.engine.kv.pool.fmt
    keys = sorted(own.keys() & drafting.keys())
    assert len(keys) == len(own) and all(layer < cfg.num_hidden_layers for _, layer, _ in keys)
    a, b = torch.stack([drafting[k] for k in keys]), torch.stack([own[k] for k in keys])
    # (1) the same values up to the two runs' rounding (every layer's, relative to a row's largest
    # value: tests/tolerances.py), plus one rounding step where that straddles one: e4m3 keeps 3
    # mantissa bits (a step is at most 2^-3 of the value, 2^-9 of the scale below the normal range),
    # bf16 keeps 7; a tile's scale (amax / 448) as far apart as the latents
    relative = (cfg.num_hidden_layers + 1) * LAMBDA * reduction_length(cfg) ** 0.5 * EPS32
    da, db = fmt.decode(a), fmt.decode(b)
    sa = a[:, fmt.scale_at:fmt.rope_at].contiguous().view(torch.float32)
    sb = b[:, fmt.scale_at:fmt.rope_at].contiguous().view(torch.float32)
    assert ((sa - sb).abs() <= relative * sb).all()
    na, nb = (d[:, :fmt.rank].reshape(len(keys), fmt.tiles, fmt.tile) for d in (da, db))
    step = 2 ** -3 * torch.maximum(na.abs(), nb.abs()) + 2 ** -9 * sb[..., None]
    assert ((na - nb).abs() <= relative * 448 * sb[..., None] + step).all()
    ra, rb = da[:, fmt.rank:], db[:, fmt.rank:]
    step = 2 ** -7 * torch.maximum(ra.abs(), rb.abs())
    assert ((ra - rb).abs() <= relative * rb.abs().amax(-1, keepdim=True) + step).all()
    # (2) the drafting run's rows replayed into plain decoding
    _storing(monkeypatch, replay=drafting)
    replayed = LLM(default_model_path(), **options).generate(prompts, params)
    assert_same_greedy(replayed, spec, logprob_tolerance(plain))


def test_fp8_cache_holds_more_tokens_in_the_same_budget(ckpt):
    path, budget = ckpt["glm_moe_dsa"], 64 * 16 * (FP32_LATENT_BYTES_PER_TOKEN + 128)  # 64 fp32 pages
    assert LLM(path, **SMALL, device_kv_budget_bytes=budget).engine.kv.allocator.num_pages == 64
    fp8 = LLM(path, **SMALL, device_kv_budget_bytes=budget, **FP8).engine
    assert fp8.kv.allocator.num_pages == budget // (16 * (FP8_LATENT_BYTES_PER_TOKEN + 128))  # 99 pages
    host = 48 * 16 * FP32_LATENT_BYTES_PER_TOKEN  # the host tier's budget holds 3x the tokens too
    assert LLM(path, **SMALL, kv_tiering=True, host_kv_budget_bytes=host, **FP8).engine.kv.allocator.num_pages == \
        host // (16 * FP8_LATENT_BYTES_PER_TOKEN)


def test_fp8_cache_stays_close_to_the_model_dtype():
    """A quantization, so not exact. On the bundled model, teacher-forced over 600 tokens of stdlib code
    (past top-k: the sparse regime), each token's logprob moves 0.05 nats or less on average and the
    most probable next token is the same at 95 % of positions or more (`sparsekv bench kv-dtype`
    measures it at length)."""
    from sparsekv.tools.bench_kv_dtype import compare_logprobs, default_text
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = []
    for options in ({}, FP8):
        llm = LLM(default_model_path(), max_model_len=1024, **options)
        ids = llm.engine.tokenizer.encode(default_text())[:600]
        outs.append(llm.generate([ids], params)[0])
    figures = compare_logprobs(outs[0], outs[1])
    assert 0 < figures["mean_abs"] < 0.05 and figures["top1_agreement"] >= 0.95


def test_prefix_disk_tier_never_mixes_latent_formats(ckpt, tmp_path):
    """Pages saved by an FP8 engine live in another namespace than a float32 engine's."""
    from sparsekv.cache.prefix_disk import namespace
    from sparsekv.cache.prefix_host import PageRows
    names = []
    for options in ({}, FP8):
        engine = LLM(ckpt["glm_moe_dsa"], **SMALL, **options).engine
        names.append(namespace(engine.config, PageRows(engine.kv.pool.slot_tensors(), 16), 0))
    assert names[0] != names[1]


def test_bench_kv_dtype_reports_capacity_quality_and_speed(tmp_path, capsys):
    """`sparsekv bench kv-dtype` on the bundled model: FP8 holds more tokens in the budget, scores the
    text close to float32 latents, and both decodes are timed."""
    import json

    from sparsekv.tools.bench import main
    out = tmp_path / "kv.json"
    assert main(["kv-dtype", "--context", "320", "--decode-steps", "4", "--repeats", "1", "--kv-tiering",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_tiering"]
    assert result["capacity"]["fp8"]["latent_bytes_per_token"] == (64 + 4 + 32 * 2) * 5  # bundled: rank 64, rope 32
    assert result["capacity_ratio"] > 2 and result["glm5_row_bytes"] == {"auto": 1152, "fp8": 656}
    assert result["quality"]["positions"] == 319 and 0 < result["quality"]["mean_abs"] < 0.05
    assert result["decode_ms"]["fp8"] > 0 and result["decode_ms"]["auto"] > 0
    assert "tokens in the budget" in capsys.readouterr().out
    assert main(["kv-dtype", "--text-file", str(out), "--context", "100000"]) == 2  # too short a text


@pytest.mark.parametrize("rank, rope", [(512, 64), (64, 32), (96, 16)])
def test_planner_sizes_fp8_latents_as_the_engine_stores_them(rank, rope):
    from sparsekv.cache.sizing import latent_bytes_per_token_layer
    cfg = SimpleNamespace(kv_lora_rank=rank, qk_rope_head_dim=rope, latent_dim=rank + rope)
    assert latent_bytes_per_token_layer(cfg, "fp8") == FP8Latent(cfg, torch.bfloat16).row_bytes
    assert latent_bytes_per_token_layer(cfg, "bf16") == PlainLatent(cfg, torch.bfloat16).row_bytes


def test_quest_bounds_the_fp8_values_attention_reads():
    """Quest's page bounds are taken over the stored (rounded) latents, so they bound the keys the
    attention reads, not the unrounded ones."""
    from sparsekv.context import SeqSlice
    from sparsekv.model.selectors import QuestSelector
    cfg = SimpleNamespace(latent_dim=72, kv_lora_rank=64, qk_rope_head_dim=8)
    fmt = FP8Latent(cfg, torch.float32)
    quest = QuestSelector(cfg, 16, 4, "cpu", [0])
    latents = torch.randn(8, 72, generator=torch.Generator().manual_seed(0))
    seq = SeqSlice("r", 0, 8, 8, torch.arange(8))
    ctx = SimpleNamespace(slot_mapping=torch.arange(8), seqs=[seq], decode_rows=1, request_start=None)
    lo, hi = quest.prepare(0, ctx, None, None, latents, SimpleNamespace(fmt=fmt))
    stored = fmt.decode(fmt.encode(latents))
    assert torch.equal(hi[3], stored[:4].amax(0)) and torch.equal(lo[7], stored[4:].amin(0))
    assert not torch.equal(stored, latents)


def test_fp8_row_scales_are_each_tiles_largest_magnitude_over_448():
    """The stored scale of every tile is FlashMLA's: the tile's largest magnitude / 448 (e4m3's
    largest finite value), so the largest entry encodes as +-448 and the row reads back the same in a
    kernel that decodes the layout. The round-trip error bound alone would also accept a smaller
    divisor (less of e4m3's range used)."""
    fmt = FP8Latent(SimpleNamespace(kv_lora_rank=256, qk_rope_head_dim=16), torch.float32)
    values = torch.randn(4, 272, generator=torch.Generator().manual_seed(1))
    rows = fmt.encode(values)
    scales = rows[:, fmt.scale_at:fmt.rope_at].contiguous().view(torch.float32)
    assert torch.equal(scales, values[:, :256].view(4, 2, 128).abs().amax(-1) / E4M3_MAX)
    codes = rows[:, :256].contiguous().view(torch.float8_e4m3fn).float().view(4, 2, 128)
    assert torch.equal(codes.abs().amax(-1), torch.full((4, 2), E4M3_MAX))
