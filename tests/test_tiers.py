"""Tiered KV cache: exact versus tiering off, integrity after every scenario, admission and config errors."""
import json
import os
import sys

import pytest
import torch

from sparsekv import LLM, ConfigError, InvalidRequest, SamplingParams
from sparsekv.tools.tiny import save_reference_checkpoint

TOPK = 8
# Different lengths: 6 stays in the dense regime (<= top-k) for a while, the others are chunked.
PROMPTS = [list(range(1, 40)), [3, 1, 4, 1, 5, 9], [(7 * i) % 250 + 1 for i in range(23)],
           [(13 * i) % 251 + 2 for i in range(60)]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
SMALL = dict(kv_page_size=16, prefill_chunk_tokens=16, max_num_batched_tokens=40, max_num_seqs=4)
LATENT_BYTES_PER_TOKEN = (32 + 8) * 4 * 4  # (kv_lora_rank + rope) x fp32 x 4 layers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("tiers"))


def tiny_checkpoints(root) -> dict[str, str]:
    """A tiny random checkpoint of each family with top-k TOPK, by family."""
    paths = {}
    for family in ("glm_moe_dsa", "deepseek_v32"):
        paths[family] = str(root / family)
        extra = dict(n_group=1, topk_group=1) if family == "deepseek_v32" else {}
        save_reference_checkpoint(paths[family], family=family, seed=1, index_topk=TOPK, **extra)
    return paths


def make(path, **options):
    torch.set_num_threads(1)
    return LLM(path, **{**SMALL, **options})


def generate(path, prompts=PROMPTS, params=GREEDY, **options):
    llm = make(path, **options)
    outs = llm.generate(prompts, params)
    assert_back_to_initial(llm.engine)
    return outs, llm


def assert_back_to_initial(engine):
    engine.check_integrity()
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_pages
    assert engine.kv.allocator.num_reserved_unallocated == 0
    if engine.config.kv_tiering:
        cache = engine.kv.pool
        assert cache.num_working_sets == 0 and cache.buffers.num_free == cache.buffers.num_pages
        stats = engine.stats()
        assert stats["host_kv_bytes"] == 0 and stats["device_kv_bytes"] == 0


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        # bit-identical floats: both runs do the same operations in the same shapes on the same rows
        # (only where the rows are kept differs), so this holds with any CPU's kernels
        assert x.logprobs == y.logprobs


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("selector", ["dsa", "quest"])
def test_tiering_is_exact(ckpt, family, selector):
    reference, _ = generate(ckpt[family], selector=selector)
    for n in (TOPK, None, 4 * TOPK):  # N = top-k, the default 2 x top-k, and roomy
        outs, llm = generate(ckpt[family], selector=selector, kv_tiering=True, device_buffer_tokens=n)
        assert_same(reference, outs)
        stats = llm.stats()
        assert stats["tier_misses"] > 0 and stats["tier_hits"] > 0
        assert sum(o.metrics["tier_misses"] for o in outs) == stats["tier_misses"]
        assert sum(o.metrics["h2d_bytes"] for o in outs) == stats["h2d_bytes"]


def _working_set_accesses(monkeypatch, prompt_lengths: dict) -> list:
    """Spy on what the model asks the tiered pool for, per full layer, in call order: ("decode",
    request, layer, first new position, the positions asked for) for a chunk of one token (a decode,
    which reads through its working set), ("prime", request, layer, [rows, k] selections) for each
    query block of a prompt's last chunk (which places them in the working set: `_prime_block`), and,
    for every layer, ("stream", request, layer, distinct positions) for each read of a longer chunk
    (a prefill reads straight from the host store). Recorded before the pool resolves anything: the
    model's selections, not the pool's bookkeeping."""
    from sparsekv.cache.tiers import TieredKVPool
    trace = []
    real_decode, real_dense, real_gather = (TieredKVPool.gather_decode_latents, TieredKVPool.dense_decode_latents,
                                            TieredKVPool.gather_latent)

    def full(pool, layer):
        return pool.leader[layer] == layer and layer not in pool.mtp_layers

    def decode(pool, seq, layer, positions):
        trace.append(("decode", seq.request_id, layer, seq.first_new_position, sorted(set(positions))))

    def gather_decode_latents(self, layer, picks):
        if full(self, layer):
            rows = picks.selected.tolist()
            for seq in picks.seqs:
                part, rows = rows[:seq.num_new_tokens], rows[seq.num_new_tokens:]
                if seq.num_new_tokens == 1:
                    decode(self, seq, layer, part[0])
        return real_decode(self, layer, picks)

    def dense_decode_latents(self, layer, seqs, length):
        if full(self, layer):
            for seq in seqs:
                if seq.num_new_tokens == 1:
                    decode(self, seq, layer, range(seq.context_len))
        return real_dense(self, layer, seqs, length)

    def gather_latent(self, layer, seq, positions):
        if seq.num_new_tokens > 1:
            trace.append(("stream", seq.request_id, layer, len(set(positions.reshape(-1).tolist()))))
        if full(self, layer):
            if seq.num_new_tokens == 1:
                decode(self, seq, layer, positions.reshape(-1).tolist())
            elif positions.dim() == 2 and seq.context_len == prompt_lengths[seq.request_id]:
                trace.append(("prime", seq.request_id, layer, positions.tolist()))
        return real_gather(self, layer, seq, positions)
    monkeypatch.setattr(TieredKVPool, "gather_decode_latents", gather_decode_latents)
    monkeypatch.setattr(TieredKVPool, "dense_decode_latents", dense_decode_latents)
    monkeypatch.setattr(TieredKVPool, "gather_latent", gather_latent)
    return trace


def _expected_tier_counts(trace: list, capacity: int, groups: dict) -> tuple[dict, int]:
    """Per request (hits, misses, rows copied host -> device) by the documented policy, replayed on
    tests/test_lru.py's brute-force LRU, one per (request, full layer); and how many decode accesses
    filled the working set exactly.
    * A prefill read streams each distinct position it asks for from the host store, once.
    * A prompt's last chunk primes: per query block, the distinct positions its rows selected when
      they fit, then its last row's (no lookup counted).
    * Each decode first promotes the last decode's new token as most recently used (no lookup).
    * A decode's positions before its new token are looked up (hits and misses, one per position and
      layer of the group); its new token is on its own row: a hit for every layer of the group. Each
      miss is copied from the host for every layer of the group."""
    from test_lru import BruteForceLRU
    lrus, last_new, counts, full = {}, {}, {}, 0
    for kind, rid, layer, *rest in trace:
        got = counts.setdefault(rid, [0, 0, 0])
        if kind == "stream":
            got[2] += rest[0]
            continue
        lru = lrus.setdefault((rid, layer), BruteForceLRU(capacity))
        if kind == "prime":
            (rows,) = rest
            distinct = sorted({p for row in rows for p in row})
            for positions in ([distinct] if len(distinct) <= capacity else []) + [rows[-1]]:
                if len(positions) <= capacity:
                    lru.access(positions)
            continue
        first_new, positions = rest
        if (rid, layer) in last_new:
            lru.access([last_new[rid, layer]])
        last_new[rid, layer] = first_new
        older = [p for p in positions if p < first_new]
        assert len(older) <= capacity  # one decode row's k positions always fit N >= k: never streamed
        full += len(older) == capacity
        hits, misses, *_ = lru.access(older)
        got[0] += (hits + len(positions) - len(older)) * len(groups[layer])
        got[1] += len(misses) * len(groups[layer])
        got[2] += len(misses) * len(groups[layer])
    return counts, full


@pytest.mark.parametrize("selector", ["dsa", "quest"])
def test_a_working_set_of_exactly_top_k_counts_every_hit_and_miss(ckpt, selector, monkeypatch):
    """N = index_topk, the smallest working set allowed: a sparse decode's k selections can fill it
    entirely, so every access evicts all that it does not reuse. Outputs are bit-identical to tiering
    off, and each request's hits and misses are exactly those of the documented LRU policy (the
    brute-force reference of tests/test_lru.py) replayed on the model's own selections: chunked
    prompts (the last chunk primes the working set), a prompt below top-k (dense decodes first),
    and a batch resolving its working sets together."""
    prompts = PROMPTS[1:3]  # 6 tokens (dense until past top-k), 23 (a chunk of 16, then 7 priming)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)
    reference, _ = generate(ckpt["glm_moe_dsa"], prompts, params, selector=selector)
    llm = make(ckpt["glm_moe_dsa"], selector=selector, kv_tiering=True, device_buffer_tokens=TOPK)
    pool = llm.engine.kv.pool
    assert pool.device_buffer_tokens == TOPK and pool.groups == {0: [0, 1, 2], 3: [3]}
    trace = _working_set_accesses(monkeypatch, {"a": len(prompts[0]), "b": len(prompts[1])})
    for rid, prompt in zip("ab", prompts):
        llm.engine.add_request(rid, prompt, params)
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert_back_to_initial(llm.engine)
    assert_same(reference, [outs["a"], outs["b"]])
    expected, full = _expected_tier_counts(trace, TOPK, pool.groups)
    assert full > 0 and {kind for kind, *_ in trace} == {"prime", "decode", "stream"}
    row = LATENT_BYTES_PER_TOKEN // 4  # one layer's latent row
    for rid in "ab":
        m = outs[rid].metrics
        assert (m["tier_hits"], m["tier_misses"], m["h2d_bytes"]) == (expected[rid][0], expected[rid][1],
                                                                      expected[rid][2] * row), rid
    stats = llm.stats()
    hits, misses, rows = map(sum, zip(*expected.values()))
    assert (stats["tier_hits"], stats["tier_misses"], stats["h2d_bytes"]) == (hits, misses, rows * row)


def test_a_prompt_block_whose_selections_exactly_fill_the_working_set_primes_them_all(ckpt, monkeypatch):
    """A prompt's last chunk places the distinct positions its query block selected in the working set
    "when they fit", N of them included: with N set to exactly the number one full layer's last block
    selected, the request's hits and misses are still the documented policy's (the brute-force LRU of
    `_expected_tier_counts`), which primes that layer with all of them before the last row's."""
    from sparsekv.cache.tiers import TieredKVPool
    prompt = PROMPTS[2]  # 23 tokens: a chunk of 16, then 7 rows that prime the working set
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    real = {name: getattr(TieredKVPool, name) for name in ("gather_decode_latents", "dense_decode_latents",
                                                            "gather_latent")}

    def run(n):
        for name, method in real.items():  # each run traces once
            monkeypatch.setattr(TieredKVPool, name, method)
        llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=n)
        trace, outs = _traced_run(monkeypatch, llm, prompt, params)
        primed = [len({p for row in entry[3] for p in row}) for entry in trace if entry[0] == "prime"]
        return trace, primed, outs[0], llm.engine.kv.pool.groups
    _, primed, _, _ = run(4 * TOPK)
    fill = primed[-1]  # the last full layer's last block: placed whole when N >= fill
    assert TOPK < fill < 4 * TOPK
    trace, primed_again, out, groups = run(fill)
    assert primed_again == primed  # tiering never changes a selection
    _assert_policy_counts(trace, fill, groups, out)


def _traced_run(monkeypatch, llm, prompt, params) -> tuple[list, list]:
    """Request "a" run to its end with its working-set accesses traced: (the trace, its finished outputs)."""
    trace = _working_set_accesses(monkeypatch, {"a": len(prompt)})
    llm.engine.add_request("a", prompt, params)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.finished]
    assert_back_to_initial(llm.engine)
    return trace, outs


def _assert_policy_counts(trace, n, groups, out) -> None:
    """Request "a"'s hits, misses and host -> device bytes are the documented policy's on a buffer of `n`."""
    expected, _ = _expected_tier_counts(trace, n, groups)
    row = LATENT_BYTES_PER_TOKEN // 4  # one layer's latent row
    m = out.metrics
    assert (m["tier_hits"], m["tier_misses"], m["h2d_bytes"]) == (expected["a"][0], expected["a"][1],
                                                                  expected["a"][2] * row)


def test_a_prompts_last_chunk_primes_the_working_set_in_query_blocks_of_one_row(ckpt, monkeypatch):
    """A query block of one row (a CPU's block budget for a real geometry: k x (heads + latent width)
    past BLOCK_ELEMENTS gives one row per block) primes the working set like a longer one: the prompt's
    last row's selections are the last placed, so the hits and misses are the documented policy's
    (`_expected_tier_counts`) and outputs stay bit-identical to tiering off."""
    monkeypatch.setattr("sparsekv.kernels.attention.BLOCK_ELEMENTS", 1)  # every query block one row
    prompt = PROMPTS[2]  # 23 tokens: a chunk of 16, then 7 rows that prime the working set
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    reference, _ = generate(ckpt["glm_moe_dsa"], [prompt], params)
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK)
    trace, outs = _traced_run(monkeypatch, llm, prompt, params)
    assert_same(reference, outs)
    primes = [entry[3] for entry in trace if entry[0] == "prime"]
    assert primes and all(len(rows) == 1 for rows in primes)
    _assert_policy_counts(trace, TOPK, llm.engine.kv.pool.groups, outs[0])


def test_a_reused_working_set_starts_empty(ckpt, monkeypatch):
    """One working set (max_num_seqs=1) serves the requests one after another: each new owner's LRUs
    start empty, so no position of the previous request counts as resident in its rows, and
    outputs stay bit-identical to tiering off."""
    from sparsekv.cache.tiers import TieredKVPool
    one = dict(max_num_seqs=1)
    reference = [generate(ckpt["glm_moe_dsa"], [p], **one)[0][0] for p in PROMPTS]
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK, **one)
    handed, real = [], TieredKVPool._working_set

    def working_set(self, request_id):
        new = request_id not in self._resident
        ws = real(self, request_id)
        if new:
            handed.append((ws.buffer, [lru.lru_order() for lru in ws.lrus.values()]))
        return ws
    monkeypatch.setattr(TieredKVPool, "_working_set", working_set)
    outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    assert handed == [(0, [[], []])] * len(PROMPTS)  # the same buffer each time, nothing resident
    assert_same(reference, outs)
    assert_back_to_initial(llm.engine)


def test_mmap_host_store_is_exact(ckpt, tmp_path):
    path = str(tmp_path / "host.kv")
    reference, _ = generate(ckpt["glm_moe_dsa"])
    outs, llm = generate(ckpt["glm_moe_dsa"], kv_tiering=True, host_store_path=path)
    assert_same(reference, outs)
    assert llm.stats()["host_store"] == "mmap"
    assert not os.path.exists(path)  # unlinked once mapped: the mapping holds the rows


def test_a_killed_engine_leaves_no_host_store_file(ckpt, tmp_path):
    """The mmap host store's file is unlinked as soon as it is mapped, so even SIGKILL mid-generation
    leaves no conversation's KV on disk (the OS frees the blocks with the mapping)."""
    import signal
    import subprocess
    import sys
    store = tmp_path / "store"
    store.mkdir()
    code = ("import sys; from sparsekv import LLM, SamplingParams\n"
            f"llm = LLM({ckpt['glm_moe_dsa']!r}, kv_tiering=True, host_store_path={str(store)!r}, max_model_len=4096)\n"
            "llm.engine.add_request('r', [t % 250 + 1 for t in range(300)], SamplingParams(max_tokens=3000, ignore_eos=True))\n"
            "llm.engine.step(); llm.engine.step()\n"
            "print(llm.stats()['host_store'], flush=True)\n"
            "while True: llm.engine.step()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mmap"  # generating, its history in the mapped store
        assert os.listdir(store) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.listdir(store) == []


def test_mmap_host_store_never_overwrites_a_file_and_takes_a_directory(ckpt, tmp_path):
    """An existing file at host_store_path is refused with a clear error and left as it was (it may be
    the user's); a directory gets a fresh uniquely named file per engine, unlinked once mapped."""
    mine = tmp_path / "notes.txt"
    mine.write_text("precious")
    with pytest.raises(FileExistsError, match="never overwrites"):
        make(ckpt["glm_moe_dsa"], kv_tiering=True, host_store_path=str(mine))
    assert mine.read_text() == "precious"
    reference, _ = generate(ckpt["glm_moe_dsa"])
    outs, llm = generate(ckpt["glm_moe_dsa"], kv_tiering=True, host_store_path=str(tmp_path))
    other = make(ckpt["glm_moe_dsa"], kv_tiering=True, host_store_path=str(tmp_path))
    assert_same(reference, outs)
    files = {llm.engine.kv.pool.host.path, other.engine.kv.pool.host.path}
    assert len(files) == 2 and all(os.path.dirname(f) == str(tmp_path) for f in files)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # each unlinked once mapped


def test_the_mmap_host_stores_file_is_private_from_its_creation(tmp_path, monkeypatch):
    """The store's file is made 0600 (no other user reads a conversation's KV in the moment before it
    is unlinked), whatever the umask, named or made in a directory; none is left behind."""
    import stat
    from sparsekv.cache import host_store
    modes, remove = [], host_store._remove_file
    monkeypatch.setattr(host_store, "_remove_file",
                        lambda path: (modes.append(stat.S_IMODE(os.stat(path).st_mode)), remove(path)))
    umask = os.umask(0)
    try:
        for path in (tmp_path / "kv", tmp_path):
            host_store.MmapTieredHostStore([0, 1], 4, 8, torch.float32, str(path)).close()
    finally:
        os.umask(umask)
    assert modes == [0o600, 0o600] and os.listdir(tmp_path) == []


def run_with_aborts(path, **options):
    engine = make(path, **options).engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
        if step == 2:
            assert engine.scheduler.find("r3").is_prefilling
            engine.abort("r3")       # aborted while prefilling: host pages only
        if step == 6:
            assert engine.kv.pool.has_working_set("r1") if engine.config.kv_tiering else True
            engine.abort("r1")       # aborted mid-generation: host pages and a working set
        engine.check_integrity()
    assert_back_to_initial(engine)
    return done


@pytest.mark.parametrize("selector", ["dsa", "quest"])
def test_abort_mid_generation_is_exact_and_frees_everything(ckpt, selector):
    reference = run_with_aborts(ckpt["glm_moe_dsa"], selector=selector)
    tiered = run_with_aborts(ckpt["glm_moe_dsa"], selector=selector, kv_tiering=True, device_buffer_tokens=TOPK)
    assert sorted(tiered) == ["r0", "r2"]
    assert_same([reference["r0"], reference["r2"]], [tiered["r0"], tiered["r2"]])


def test_device_latent_bytes_are_flat_and_host_holds_history(ckpt):
    outs, llm = generate(ckpt["glm_moe_dsa"], kv_tiering=True)
    working_set = (2 * TOPK + 1) * LATENT_BYTES_PER_TOKEN
    for out in outs:
        m = out.metrics
        held = -(-(len(out.prompt_token_ids) + len(out.token_ids)) // 16) * 16
        assert m["device_latent_bytes"] == working_set          # the same for 6 and 60 prompt tokens
        assert m["host_kv_bytes"] == held * LATENT_BYTES_PER_TOKEN
        assert m["device_indexer_bytes"] == held * 16 * 4 * 2   # index_head_dim x fp32 x 2 full layers
        assert m["d2h_bytes"] == (len(out.prompt_token_ids) + len(out.token_ids) - 1) * LATENT_BYTES_PER_TOKEN
        assert 0 <= m["tier_miss_rate"] <= 1
    stats = llm.stats()
    for key in ("device_kv_bytes", "device_latent_bytes", "device_indexer_bytes", "host_kv_bytes",
                "host_kv_budget_bytes", "tier_hits", "tier_misses", "tier_miss_rate", "h2d_bytes", "d2h_bytes"):
        assert key in stats


def test_a_request_still_prefilling_holds_no_device_latent_bytes(ckpt):
    """A chunked prompt's working set is made for its last chunk: until then the request's metrics count
    no device latent bytes (its history is in the host store), from then on one working set's."""
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True)
    engine, pool = llm.engine, llm.engine.kv.pool
    req = engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # the first of 39 prompt tokens' chunks of 16
    assert req.is_prefilling and not pool.has_working_set("a")
    assert engine.request_metrics(req)["device_latent_bytes"] == 0
    while not pool.has_working_set("a"):
        engine.step()
    assert engine.request_metrics(req)["device_latent_bytes"] == pool.working_set_bytes() > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert_back_to_initial(engine)


def test_a_prefill_block_reads_each_selected_row_from_the_host_once(ckpt, monkeypatch):
    """The rows of a prefill block select overlapping positions; each distinct one crosses the host
    link once per layer (h2d = the distinct positions asked for, not every pick)."""
    from sparsekv.cache.tiers import TieredKVPool
    asked, picks, real = [], [], TieredKVPool.gather_latent

    def spy(self, layer, seq, positions):
        asked.append(positions.unique().numel())
        picks.append(positions.numel())
        return real(self, layer, seq, positions)
    monkeypatch.setattr(TieredKVPool, "gather_latent", spy)
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True)
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.metrics["h2d_bytes"] == sum(asked) * LATENT_BYTES_PER_TOKEN // 4  # one layer's row each
    assert sum(asked) < sum(picks)


def _selections(monkeypatch, replay: list | None = None, check=None) -> list:
    """Record every selection the DSA selector makes, in order, as (layer, query positions, selected).
    With `replay`: each call returns replay's selection instead (same layer and rows, checked), after
    `check(layer, seq, state, positions, selected, cache)`. Decodes select one request at a time."""
    from sparsekv.model.selectors import DSASelector
    made, real, busy = [], {n: getattr(DSASelector, n) for n in ("select", "select_decode")}, []

    def spy(name):
        def call(self, layer, seq, state, q, positions, k, cache):
            if busy:  # select_decode's own call of select
                return real[name](self, layer, seq, state, q, positions, k, cache)
            busy.append(name)
            try:
                if replay is None:
                    out = real[name](self, layer, seq, state, q, positions, k, cache)
                else:
                    want_layer, want_positions, out = replay[len(made)]
                    assert (want_layer, want_positions) == (layer, positions.tolist())
                    check(layer, seq, state, positions, out, cache)
                made.append((layer, positions.tolist(), out.clone()))
                return out
            finally:
                busy.pop()
        return call
    monkeypatch.setattr(DSASelector, "batch_decode", False)
    for name in real:
        monkeypatch.setattr(DSASelector, name, spy(name))
    return made


def test_fp8_indexer_keys_shrink_the_device_and_select_within_their_rounding(ckpt, monkeypatch):
    """FP8 indexer keys only move the index scores, by at most what the keys' e4m3 rounding can, so a
    selection can differ from float32 keys' only at a near-tie, and it is a whole key away where it
    does (a discrete change, no tolerance covers it: see tests/tolerances.py). So: (1) replayed into
    a run with float32 keys, the FP8 run's selections give its tokens and logprobs bit for bit (the
    keys' format changes nothing else), and (2) each of those selections is a top-k of the float32
    keys' exact scores (computed on the same inputs) up to that rounding."""
    from sparsekv.cache.index_keys import FP8_MAX
    from tolerances import LAMBDA, e4m3_error, gamma
    _, base = generate(ckpt["glm_moe_dsa"], kv_tiering=True)
    made = _selections(monkeypatch)
    outs, llm = generate(ckpt["glm_moe_dsa"], kv_tiering=True, indexer_key_dtype="fp8_e4m3")
    assert llm.engine.kv.pool.index_bytes_per_token() == (16 + 4) * 2 < base.engine.kv.pool.index_bytes_per_token()
    checked = []

    def check(layer, seq, state, positions, selected, cache):
        """I[t, s] = sum_h w_h ReLU(q_h . k_s) (model/indexer.py, D^-1/2 folded into w as there). A
        key stored as e4m3 is off by delta_d, |delta_d| <= E_d (e4m3_error, per-key scale amax / 448),
        which moves I by sum_d delta_d c_d, |c_d| <= C_d = sum_h |w_h q_hd| (ReLU: 1-Lipschitz); the
        roundings independent, by about sqrt(sum_d (C_d E_d)^2), rarely LAMBDA times more (as
        tests/tolerances.py), plus float32's H dot products of length D and their weighted sum
        (gamma_(D+H) of the terms' magnitudes). A selection made from those scores keeps every
        chosen key's I + b >= every other's I - b, b the sum of both."""
        q, w = state[0].double(), (state[1] * cache.index.keys[layer].shape[1] ** -0.5).double()
        total = int(positions.max()) + 1
        keys = torch.empty(total, q.shape[-1], dtype=torch.float32)
        for at, k in cache.index_key_segments(layer, seq):
            at = torch.arange(at, at + k.shape[0]) if isinstance(at, int) else at
            keep = at < total
            keys[at[keep]] = k[keep].float()
        scale = keys.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # as IndexKeyCache.write
        rounding, g = e4m3_error(keys, scale), gamma(q.shape[-1] + q.shape[-2])
        exact = torch.einsum("sh,sht->st", w, torch.einsum("shd,td->sht", q, keys.double()).relu())
        c = torch.einsum("sh,shd->sd", w.abs(), q.abs())  # C_d, per query row
        stored = torch.einsum("sd,td->st", c, keys.double().abs() + rounding)
        slack = LAMBDA * torch.einsum("sd,td->st", c ** 2, rounding ** 2).sqrt() + g * stored
        for row, p in enumerate(positions.tolist()):
            if p + 1 <= selected.shape[-1]:
                continue  # dense regime: every visible key
            chosen = torch.zeros(total, dtype=torch.bool)
            chosen[selected[row]] = True
            lo, hi = exact[row, :p + 1] - slack[row, :p + 1], exact[row, :p + 1] + slack[row, :p + 1]
            assert hi[chosen[:p + 1]].min() >= lo[~chosen[:p + 1]].max(), (layer, p)
            checked.append(p)
    _selections(monkeypatch, replay=made, check=check)
    replayed, _ = generate(ckpt["glm_moe_dsa"], kv_tiering=True)
    assert_same(outs, replayed)
    assert len(checked) > 100


def test_host_budget_admission(ckpt):
    path = ckpt["glm_moe_dsa"]
    budget = 6 * 16 * LATENT_BYTES_PER_TOKEN  # 6 pages = 96 tokens of host KV
    reference = make(path, num_kv_pages=6).generate(PROMPTS[:1], GREEDY)
    llm = make(path, kv_tiering=True, host_kv_budget_bytes=budget)
    engine = llm.engine
    engine.add_request("ok", PROMPTS[0], GREEDY)               # 39 + 24 tokens: 4 pages
    engine.step()
    with pytest.raises(InvalidRequest, match="host_kv_budget_bytes"):
        engine.add_request("big", [1] * 90, GREEDY)              # 90 + 24 > 96: never fits
    engine.add_request("later", PROMPTS[2], SamplingParams(max_tokens=30))   # fits alone: waits
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    assert_same(reference, [done["ok"]])                       # the running request was unaffected
    assert "later" in done and "big" not in done
    assert_back_to_initial(engine)


@pytest.mark.parametrize("options,match", [
    (dict(kv_tiering=True, device_buffer_tokens=TOPK - 1), "index_topk"),
    (dict(device_buffer_tokens=16), "kv_tiering"),
    (dict(host_kv_budget_bytes=1 << 20), "kv_tiering"),
    (dict(kv_tiering=True, attention="dense"), "sparse"),
    (dict(selector="nsa"), "selector"),
    (dict(selector="quest", quest_page_tokens=5), "quest_page_tokens"),
    (dict(kv_tiering=True, indexer_key_dtype="int4"), "indexer_key_dtype"),
    (dict(kv_tiering=True, host_kv_budget_bytes=1000), "host_kv_budget_bytes"),
    (dict(kv_tiering=True, device_kv_budget_bytes=1000), "device_kv_budget_bytes"),
    (dict(device_kv_budget_bytes=1000), "device_kv_budget_bytes"),
    (dict(kv_tiering=True, host_store_path="/no/such/dir/kv"), "host_store_path"),
])
def test_bad_configuration_is_a_clear_error(ckpt, options, match):
    with pytest.raises((ConfigError, FileNotFoundError), match=match):
        make(ckpt["glm_moe_dsa"], **options)


def test_device_budget_sizes_both_modes(ckpt):
    path = ckpt["glm_moe_dsa"]
    budget = 64 * 16 * (LATENT_BYTES_PER_TOKEN + 128)       # 64 pages untiered
    assert make(path, device_kv_budget_bytes=budget).engine.kv.allocator.num_pages == 64
    tiered = make(path, kv_tiering=True, device_kv_budget_bytes=budget).engine
    assert tiered.kv.allocator.num_pages > 4 * 64                 # indexer keys only, plus 4 working sets


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiering_is_exact_on_cuda(ckpt):
    reference, _ = generate(ckpt["glm_moe_dsa"], device="cuda")
    outs, llm = generate(ckpt["glm_moe_dsa"], device="cuda", kv_tiering=True, device_buffer_tokens=TOPK)
    assert_same(reference, outs)
    assert llm.stats()["tier_misses"] > 0


@pytest.mark.parametrize("selector", ["dsa", "quest"])
def test_tiering_is_exact_under_emulated_cuda_ordering(ckpt, selector, emulated_cuda):
    """The CUDA test above, on this CPU: every backup and every shared layer's fetch lands as late as
    the streams allow, with chunked prefill, a batch of different lengths and N = top-k."""
    reference, _ = generate(ckpt["glm_moe_dsa"], selector=selector)
    outs, llm = generate(ckpt["glm_moe_dsa"], selector=selector, kv_tiering=True, device_buffer_tokens=TOPK)
    assert_same(reference, outs)
    assert emulated_cuda["backups"] > 0 and emulated_cuda["fetches"] > 0
    assert not llm.engine.kv.pool.link._landing  # every side-stream fetch was waited on in its step


@pytest.mark.parametrize("skipped", ["flush", "wait"])
def test_emulated_cuda_ordering_catches_a_missing_synchronisation(ckpt, skipped, emulated_cuda, monkeypatch):
    """The emulation can fail: without the flush before host reads, or a shared layer's wait for its
    side-stream rows, the tiered engine computes on stale rows and its logprobs change."""
    from sparsekv.cache.host_store import HostLink
    reference, _ = generate(ckpt["glm_moe_dsa"])
    monkeypatch.setattr(HostLink, skipped, lambda self, *args: None)
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK)
    for rows in llm.engine.kv.pool.ws.values():  # stale rows read as zeros, not uninitialised memory (maybe NaN)
        rows.zero_()
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(a.logprobs != b.logprobs for a, b in zip(reference, outs, strict=True))


@pytest.mark.parametrize("fp8", [False, True])
def test_index_key_segments_cover_the_history_in_order(fp8, monkeypatch):
    """Views of long runs and one gather of the rest hold exactly the keys a full gather reads."""
    import sparsekv.cache.pool as pool
    from sparsekv.cache.index_keys import IndexKeyCache
    from sparsekv.context import SeqSlice
    monkeypatch.setattr(pool, "MIN_VIEW_RUN", 8)
    cache = IndexKeyCache([0], num_slots=64, dim=4, dtype=torch.float32, device="cpu", fp8=fp8)
    cache.write(0, torch.arange(64), torch.randn(64, 4))
    runs = ((0, 40, 12), (12, 8, 4), (16, 20, 10))          # a long run, a short one, a long one
    slots = torch.cat([torch.arange(s, s + n) for _, s, n in runs])
    seq = SeqSlice("r", 0, 1, 26, slots, runs=runs)
    rebuilt = torch.empty(26, 4)
    kinds = []
    for positions, keys in cache.segments(0, seq):
        kinds.append(type(positions).__name__)
        if isinstance(positions, int):
            rebuilt[positions:positions + keys.shape[0]] = keys
        else:
            rebuilt[positions] = keys
    expected = cache.keys[0][slots].float() if not fp8 else (
        cache.keys[0][slots].view(torch.float8_e4m3fn).float() * cache.scales[0][slots][:, None])
    assert kinds == ["int", "int", "Tensor"]
    assert torch.equal(rebuilt, expected)


def test_fp8_index_keys_keep_each_keys_scale_and_an_all_zero_key():
    """FP8 indexer keys: e4m3 codes with one fp32 scale per key (its largest magnitude / 448, so that
    entry is kept to two float32 roundings and none overflows e4m3); an all-zero key reads back as
    zeros, not NaN (0 / 0), through every read path: segments, padded batches and pages."""
    from sparsekv.cache.index_keys import FP8_MAX, IndexKeyCache
    from sparsekv.context import SeqSlice
    from tolerances import U32, e4m3_error
    cache = IndexKeyCache([0], num_slots=8, dim=4, dtype=torch.float32, device="cpu", fp8=True)
    keys = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 3.0], [1e-3, 2e-3, -4e-3, 0.0], [500.0, 1.0, -7.0, 2.0],
                         [0.0, 0.0, 0.0, 0.0], [-1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [9.0, 8.0, 7.0, 6.0]])
    cache.write(0, torch.arange(8), keys)
    assert torch.equal(cache.scales[0][1:4], keys[1:4].abs().amax(-1) / FP8_MAX)
    seq = SeqSlice("r", 0, 1, 8, torch.arange(8), runs=((0, 0, 8),))
    (_, read), = cache.segments(0, seq)
    padded = cache.padded(0, [seq])[0]
    paged, _, _ = cache.pages(0, [seq], 4)
    for got in (read, padded, paged.reshape(8, 4)):
        assert torch.equal(got[0], torch.zeros(4)) and torch.equal(got[4], torch.zeros(4))
        scale = keys.abs().amax(-1, keepdim=True) / FP8_MAX
        assert ((got - keys).abs() <= e4m3_error(keys, scale)).all()
        assert (got.abs().amax(-1) <= keys.abs().amax(-1).double() * (1 + U32) ** 2).all()


def test_bench_tiers_sweep_and_fixed_budget(ckpt, tmp_path, capsys):
    """`sparsekv bench tiers`: the sweep reports flat device latent bytes and writes its plots; the
    fixed-budget mode admits `--fit` requests with tiering off, more with it on, all of them unbounded."""
    from sparsekv.tools.bench_tiers import main
    from tolerances import gamma
    out = tmp_path / "sweep.json"
    assert main(["--model", ckpt["glm_moe_dsa"], "--contexts", "64,512", "--buffers", "1,2", "--steps", "3",
                 "--skip-natural", "--plot-dir", str(tmp_path), "--json", str(out)]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    tiered = [r for r in sweep if r.get("buffer_x_topk") == 1]
    assert len(tiered) == 2 and tiered[0]["device_latent_bytes"] == tiered[1]["device_latent_bytes"] > 0
    off = [r for r in sweep if r["tiering"] == "off"]
    assert off[1]["device_latent_bytes"] > off[0]["device_latent_bytes"]
    assert all(os.path.exists(p) for p in json.loads(out.read_text())["plots"])
    out = tmp_path / "conc.json"
    assert main(["--model", ckpt["glm_moe_dsa"], "--concurrency", "--concurrency-context", "256",
                 "--max-requests", "8", "--steps", "3", "--latency-steps", "3", "--json", str(out)]) == 0
    conc = json.loads(out.read_text())["concurrency"]
    assert conc["off"]["admitted"] == 4 and conc["on"]["admitted"] == conc["off_unbounded"]["admitted"] == 8
    assert "batching ceiling" in capsys.readouterr().out
    out = tmp_path / "natural.json"
    assert main(["--model", ckpt["glm_moe_dsa"], "--skip-sweep", "--natural-context", "64", "--natural-steps", "6",
                 "--warmup", "2", "--buffers", "1,2", "--fp8", "--json", str(out)]) == 0
    natural = json.loads(out.read_text())["natural"]
    assert natural["exact"] and set(natural["miss_rate_by_buffer"]) == {"1", "2"}
    # per index group, replayed from the selections: weighted by the layers each serves, the LRU rates
    # give back the engine's own steady-state rate; the offline optimum never misses more than LRU
    groups = natural["groups"]
    # FP8 against the reference: every decode step's selection of each full layer paired (the first of
    # the 6 tokens comes from the prefill); the metrics themselves: test_fp8_effect_*
    assert natural["fp8"]["selections_compared"] == len(groups) * (6 - 1)
    assert groups and sum(g["serves"] for g in groups) == json.load(open(os.path.join(ckpt["glm_moe_dsa"], "config.json")))["num_hidden_layers"]
    weighted = sum(g["lru_miss_rate"] * g["serves"] for g in groups) / sum(g["serves"] for g in groups)
    # float64 on both sides: the engine's misses / lookups rounded once; here a rate per group, its
    # product with the layers served, their sum and the division (all terms >= 0): gamma_(G+4) relative
    exact = gamma(len(groups) + 4, sys.float_info.epsilon) * natural["steady_miss_rate"]
    assert weighted == pytest.approx(natural["steady_miss_rate"], rel=0, abs=exact) and natural["steady_miss_rate"] > 0
    assert all(g["compulsory_miss_rate"] <= g["optimal_miss_rate"] <= g["lru_miss_rate"] for g in groups)


def test_bench_tiers_fixed_budget_ratios_are_tiering_on_over_off(ckpt, monkeypatch, capsys):
    """The fixed-budget figures on constructed measurements: tiering on admits 8 where off admits 4
    (x2), at 30 decode tokens/s against 20 (x1.5), p99 at concurrency 1 of 2 ms against 1 ms (x2); the
    unbounded ceiling's 40 tokens/s is x2 of off, of which tiering reaches 75 %."""
    from sparsekv.tools import bench_tiers
    figures = {"off": (4, 20.0, 1.0), "on": (8, 30.0, 2.0), "off_unbounded": (8, 40.0, 1.0)}

    def interleaved(ckpt_, context, steps, submit, configs):
        return {name: {"admitted": figures[name][0], "tokens_per_s": figures[name][1], "p99_ms": figures[name][2],
                       "median_ms": 1.0, "device_kv_bytes": 1, "host_kv_bytes": 0, "achieved_gbps": 1.0}
                for name in configs}
    monkeypatch.setattr(bench_tiers, "_interleaved", interleaved)
    monkeypatch.setattr(bench_tiers, "device_bandwidth_gbps", lambda args: 10.0)
    args = bench_tiers.parse_args(["--concurrency", "--concurrency-context", "256", "--max-requests", "8"])
    r = bench_tiers.concurrency(args, ckpt["glm_moe_dsa"])
    assert (r["admitted_ratio"], r["throughput_ratio"], r["p99_ratio_c1"], r["ceiling_ratio"]) == (2.0, 1.5, 2.0, 2.0)
    assert "tiering reaches 75% of it" in capsys.readouterr().out


def test_bench_tiers_row_counts_transfers_both_ways_and_misses_after_the_first_step():
    """3 MB host -> device and 3 MB device -> host over 3 steps: 2 MB a token; 30 misses and 90 hits
    after the first step: 25 %, its 10 misses reported apart."""
    from sparsekv.tools.bench_tiers import _row
    before = {"tier_misses": 10, "tier_hits": 90, "h2d_bytes": 1e6, "d2h_bytes": 0}
    after = {"tier_misses": 40, "tier_hits": 180, "h2d_bytes": 4e6, "d2h_bytes": 3e6, "device_kv_bytes": 5,
             "device_latent_bytes": 4, "device_indexer_bytes": 1}
    row = _row(512, [1.0, 3.0, 2.0], before, after, steps=3)
    assert row["transfer_mb_per_token"] == 2.0 and row["miss_rate"] == 0.25 and row["first_step_misses"] == 10
    assert (row["ms"], row["host_kv_bytes"]) == (2.0, 0)


class FakeTierEngine:
    """Its first step misses 100 times (a cold working set), every later one once in 4 lookups."""

    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1

    def stats(self) -> dict:
        warm = max(self.steps - 1, 0)
        return {"tier_misses": 100 * min(self.steps, 1) + warm, "tier_hits": 3 * warm, "device_kv_bytes": 1,
                "device_latent_bytes": 1, "device_indexer_bytes": 0}


def test_bench_tiers_sweep_reports_the_cold_first_step_apart(monkeypatch):
    from sparsekv.tools import bench_tiers
    engines = []
    monkeypatch.setattr(bench_tiers, "make_engine", lambda ckpt, max_len, **opts: engines.append(FakeTierEngine())
                        or engines[-1])
    monkeypatch.setattr(bench_tiers, "synthetic_admit", lambda engine, request_id, context, max_tokens: True)
    monkeypatch.setattr(bench_tiers, "decode_bytes_per_step", lambda engine, context: 0)
    rows = bench_tiers.measure_together("ckpt", 512, 4, {"on": {}})
    assert rows["on"]["first_step_misses"] == 100 and rows["on"]["miss_rate"] == 0.25
    assert engines[0].steps == 1 + 4


def test_fp8_effect_measures_overlap_logprob_change_and_greedy_agreement():
    """The FP8 comparison's figures on hand-made runs: selections paired by (layer, context) (one the
    reference lacks is skipped), overlap as the shared fraction, greedy agreement as the fraction of
    equal argmax tokens; a run against itself agrees everywhere."""
    from sparsekv.tools.bench_tiers_natural import _fp8_effect
    ref = {"selections": [(0, 10, frozenset({1, 2, 3, 4})), (3, 10, frozenset({1, 2, 3, 4})),
                          (0, 11, frozenset({1, 2, 3, 4}))],
           "logprobs": [{5: -1.0}, {6: -2.0}], "greedy": [5, 6, 7, 8]}
    fp8 = {"selections": [(0, 10, frozenset({1, 2, 3, 4})), (3, 10, frozenset({1, 2, 9, 8})),
                          (0, 11, frozenset({9, 8, 7, 6})), (0, 12, frozenset({1}))],
           "logprobs": [{5: -1.5}, {6: -2.0}], "greedy": [5, 6, 0, 8]}
    assert _fp8_effect(ref, fp8) == {"selections_compared": 3, "topk_overlap_mean": 0.5, "topk_overlap_min": 0.0,
                                     "max_abs_logprob_change": 0.5, "mean_abs_logprob_change": 0.25,
                                     "greedy_agreement": 0.75}
    same = _fp8_effect(ref, ref)
    assert same["greedy_agreement"] == same["topk_overlap_min"] == 1.0 and same["max_abs_logprob_change"] == 0.0


def test_quest_selection_does_not_depend_on_prefill_chunking(ckpt):
    """A query scores its own page by the bound over that page's positions up to itself, so how the
    prompt is chunked (the whole prompt, 16 or 3 tokens a step) changes nothing beyond rounding."""
    from tolerances import assert_same_greedy, logprob_tolerance
    runs = [generate(ckpt["glm_moe_dsa"], selector="quest", prefill_chunk_tokens=c, max_num_batched_tokens=max(c, 8))
            for c in (64, 16, 3)]
    for other, _ in runs[1:]:  # other chunks: other row groups in every matrix product
        assert_same_greedy(runs[0][0], other, logprob_tolerance(runs[0][1]))


def test_quest_own_page_bounds_match_brute_force():
    """prepare's per-row bounds: min/max over the row's page, from the page start to the row itself,
    including positions cached before the chunk."""
    from types import SimpleNamespace
    from sparsekv.context import SeqSlice
    from sparsekv.cache.latent_format import PlainLatent
    from sparsekv.model.selectors import QuestSelector
    cfg = SimpleNamespace(latent_dim=6)
    quest, pt = QuestSelector(cfg, 64, 4, "cpu", [0]), 4
    cache = SimpleNamespace(fmt=PlainLatent(cfg, torch.float32))
    latents = torch.randn(23, 6, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(23) + 8  # positions p live in slot p + 8 (page (p + 8) // 4)
    done = 0
    for n in (5, 1, 7, 3, 6, 1):  # chunks starting on and off page boundaries
        seq = SeqSlice("r", 0, n, done + n, slots[:done + n])
        ctx = SimpleNamespace(slot_mapping=slots[done:done + n], seqs=[seq], decode_rows=1, request_start=None)
        lo, hi = quest.prepare(0, ctx, None, None, latents[done:done + n], cache)
        for i in range(n):
            p = done + i
            start = p - (p + 8) % pt
            assert torch.equal(lo[i], latents[start:p + 1].amin(0)) and torch.equal(hi[i], latents[start:p + 1].amax(0))
        done += n


def _quest_brute_force(latents, q, p, pt, total, k):
    """Quest's documented selection for a query row at position p: every position takes its page's
    bound over the page's positions <= p, max over heads of sum_i max(q_i m_i, q_i M_i); later
    positions are masked; the top k by `select_topk`."""
    from sparsekv.kernels.attention import select_topk
    scores = torch.full((total,), float("-inf"))
    for start in range(0, p + 1, pt):
        seen = latents[start:min(start + pt, p + 1)]
        lo, hi = seen.amin(0), seen.amax(0)
        scores[start:min(start + pt, p + 1)] = torch.maximum(q * lo, q * hi).sum(-1).amax()
    return select_topk(scores[None], k)[0]


def test_quest_selects_its_documented_pages_in_prefill_and_batched_verification_rows():
    """Quest's `select` (one request) and `select_group` (a batch of decodes) against the documented
    rule, brute force, for a prefill chunk's rows and then a verification chunk's (the newest token
    and two drafts). A draft after a row puts a large value in the row's page: each row must score
    its own page over positions up to itself only, never over the later drafts. Small integer
    latents and queries make every bound exact in fp32, so the sets must be equal, ties included."""
    from types import SimpleNamespace
    from sparsekv.cache.latent_format import PlainLatent
    from sparsekv.context import ForwardContext, SeqSlice
    from sparsekv.model.selectors import QuestSelector
    pt, dim, heads, k = 4, 3, 2, 4
    cfg = SimpleNamespace(latent_dim=dim)
    quest, cache = QuestSelector(cfg, 32, pt, "cpu", [0]), SimpleNamespace(fmt=PlainLatent(cfg, torch.float32))
    g = torch.Generator().manual_seed(5)
    latents = torch.randint(-3, 4, (11, dim), generator=g).float()
    latents[8], latents[9, 0] = 0.0, 20.0        # the newest token scores 0; its first draft far above any page
    q = torch.randint(-1, 2, (11, heads, dim), generator=g).float()
    q[:, 0, 0] = 1.0
    positions = torch.arange(11)
    slots = torch.tensor([5, 2, 7])[positions // pt] * pt + positions % pt
    prefill = SeqSlice("r", 0, 8, 8, slots[:8])
    state = quest.prepare(0, ForwardContext(torch.zeros(8, dtype=torch.long), positions[:8], slots[:8], [prefill],
                                            torch.arange(0), decode_rows=3), None, None, latents[:8], cache)
    rows = slice(k, 8)  # rows that see more than k positions
    got = quest.select(0, prefill, (state[0][rows], state[1][rows]), q[rows], positions[rows], k, None)
    for row, p in zip(got, range(k, 8)):
        assert torch.equal(row, _quest_brute_force(latents, q[p], p, pt, 8, k)), p
    verify = SeqSlice("r", 0, 3, 11, slots)
    own = quest.prepare(0, ForwardContext(torch.zeros(3, dtype=torch.long), positions[8:], slots[8:], [verify],
                                          torch.arange(0), decode_rows=3), None, None, latents[8:], cache)
    alone = quest.select(0, verify, own, q[8:], positions[8:], k, None)
    batched = quest.select_group(0, [verify], (own[0][None], own[1][None]), q[None, 8:], positions[None, 8:], k,
                                 None, False)[0]
    for i, p in enumerate(range(8, 11)):
        want = _quest_brute_force(latents, q[p], p, pt, 11, k)
        assert torch.equal(alone[i], want) and torch.equal(batched[i], want), p
    assert 8 not in alone[0].tolist()  # the newest token's page is not raised by its draft


def test_quest_bounds_with_drafts_follow_the_positions_written_on_both_paths():
    """Quest with drafts, batched, on the engine's path and as a decode graph's pieces run it (`prepare`
    in fixed shapes, with `rewind` before and `remember` after), over three drafting requests of 3, 2
    and 3 rows (pages of 2 tokens: a step's rows share a page, open one, or start inside one), through
    verification steps that accept all, some or none of their drafts, against the documented rule
    by brute force: a row's own-page bound is over its page's positions up to itself as last written
    (a rejected draft's are rewritten), and a page's bound after a step over its positions up to the
    step's last. Small integer latents: every bound exact, so equal bit for bit."""
    from types import SimpleNamespace
    from sparsekv.cache.latent_format import PlainLatent
    from sparsekv.context import ForwardContext, SeqSlice
    from sparsekv.model.selectors import QuestSelector
    pt, dim, page_size = 2, 3, 32
    cfg = SimpleNamespace(latent_dim=dim)
    cache = SimpleNamespace(fmt=PlainLatent(cfg, torch.float32))
    engine, pieces = (QuestSelector(cfg, 4 * page_size, pt, "cpu", [0, 1]) for _ in range(2))
    g = torch.Generator().manual_seed(11)
    bases = (0, page_size, 2 * page_size, 3 * page_size)  # each request's slots: one KV page of its own
    written: list[dict[int, torch.Tensor]] = [{}, {}, {}, {}]  # each request's latents by position, as last written

    def context(starts: list[int], rows: list[int], piece: bool, drafts=(0, 0, 0, 0)) -> ForwardContext:
        seqs, slots, positions, first_rows, row = [], [], [], [], 0
        for i, (start, n) in enumerate(zip(starts, rows)):
            if n == 0:  # not in this step
                continue
            end = start + n
            seqs.append(SeqSlice(f"r{i}", row, row + n, end, torch.arange(bases[i], bases[i] + end),
                                 runs=((0, bases[i], page_size),), num_drafts=drafts[i]))
            slots += [bases[i] + p for p in range(start, end)]
            positions += range(start, end)
            first_rows += [row] * n
            row += n
        return ForwardContext(torch.zeros(row, dtype=torch.long), torch.tensor(positions), torch.tensor(slots), seqs,
                              torch.arange(0), decode_rows=3,
                              request_start=torch.tensor(first_rows) if piece else None)

    def bound(i: int, position: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen = torch.stack([written[i][q] for q in range(position - position % pt, upto + 1)])
        return seen.amin(0), seen.amax(0)

    def step(starts: list[int], rows: list[int], pieces_too: bool = True, drafts=(0, 0, 0, 0)) -> None:
        latents = torch.randint(-4, 5, (sum(rows), dim), generator=g).float()
        row = 0
        for i, (start, n) in enumerate(zip(starts, rows)):
            if n == 0:
                continue
            written[i] = {q: t for q, t in written[i].items() if q < start}  # past the accepted: rewritten
            written[i].update({start + j: latents[row + j] for j in range(n)})
            row += n
        for layer in (0, 1):
            got = engine.prepare(layer, context(starts, rows, False, drafts), None, None, latents, cache)
            state = got
            if pieces_too:  # (a prefill chunk never runs as the pieces: the engine's path for both)
                ctx = context(starts, rows, True)
                if layer == 0:
                    pieces.rewind(ctx)
                state = pieces.prepare(layer, ctx, None, None, latents, cache)
                pieces.remember(layer, ctx, state)
            else:
                pieces.prepare(layer, context(starts, rows, False, drafts), None, None, latents, cache)
            row = 0
            for i, (start, n) in enumerate(zip(starts, rows)):
                for p in range(start, start + n):
                    lo, hi = bound(i, p, p)
                    for own in (got, state):
                        assert torch.equal(own[0][row], lo) and torch.equal(own[1][row], hi), (starts, layer, i, p)
                    row += 1
                for p in range(start - start % pt, start + n, pt):  # each page the step wrote
                    lo, hi = bound(i, p, min(p + pt - 1, start + n - 1))
                    page = (bases[i] + p) // pt
                    for selector in (engine, pieces):
                        assert torch.equal(selector.lo[layer][page], lo) and torch.equal(selector.hi[layer][page], hi), \
                            (starts, layer, i, p)
        for selector in (engine, pieces):
            selector.check_integrity({"r0", "r1", "r2", "r3"})

    step([0, 0, 0, 0], [5, 4, 7, 0], pieces_too=False)   # the prompts (chunks: nothing kept)
    step([5, 4, 7, 0], [3, 2, 3, 0])   # verification: the newest token and its drafts
    step([8, 5, 8, 0], [3, 2, 3, 0])   # all accepted / none / none (rewinds inside a page the last step wrote)
    step([9, 7, 11, 0], [3, 2, 3, 0])  # none / all / all but the last
    step([10, 8, 13, 0], [3, 2, 3, 5], pieces_too=False)  # with a prompt's chunk: each decode on its own
    step([12, 9, 14, 5], [1, 2, 3, 3])  # a request without drafts this step
    step([13, 10, 0, 8], [3, 2, 0, 3])  # r2 left out: it keeps its own rows, not the step's tensors
    step([16, 12, 15, 9], [3, 2, 3, 2])  # r2 back inside a page it wrote two steps before
    step([0, 14, 18, 11], [0, 2, 3, 3])  # r0 left out
    step([18, 16, 19, 12], [3, 2, 2, 1])  # r0 back at the first position of a page it wrote
    for selector in (engine, pieces):  # r1 preempted: recomputed in one chunk ending in its 2 drafts
        selector.forget("r1")
    step([21, 0, 20, 13], [3, 19, 3, 2], pieces_too=False, drafts=(0, 2, 0, 0))
    step([24, 17, 22, 15], [3, 3, 3, 3])  # both of r1's drafts rejected: 17 written again, inside its page
    for selector in (engine, pieces):
        selector.forget("r1")
    step([27, 0, 25, 18], [3, 20, 3, 2], pieces_too=False, drafts=(0, 2, 0, 0))
    step([30, 18, 28, 20], [3, 3, 3, 3])  # both rejected again: 18 written again, its page's first position


def test_quest_keeps_one_steps_bounds_and_each_left_out_request_its_own_rows():
    """What Quest keeps for drafting: the last step's tensors, shared by its requests, and for a request
    left out of a step a copy of its own rows (the step before goes with its last request); its
    integrity check fails when a left-out request still points into an earlier step's tensors."""
    from types import SimpleNamespace
    from sparsekv.cache.latent_format import PlainLatent
    from sparsekv.context import ForwardContext, SeqSlice
    from sparsekv.model.selectors import Kept, QuestSelector
    cfg = SimpleNamespace(latent_dim=3)
    cache = SimpleNamespace(fmt=PlainLatent(cfg, torch.float32))
    selector, g = QuestSelector(cfg, 64, 2, "cpu", [0]), torch.Generator().manual_seed(3)

    def step(rows: list[tuple[int, int, int]]) -> None:  # (request, first position, rows) each
        seqs, slots, positions, at = [], [], [], 0
        for i, start, n in rows:
            seqs.append(SeqSlice(f"r{i}", at, at + n, start + n, torch.arange(16 * i, 16 * i + start + n),
                                 runs=((0, 16 * i, 16),)))
            slots += range(16 * i + start, 16 * i + start + n)
            positions += range(start, start + n)
            at += n
        ctx = ForwardContext(torch.zeros(at, dtype=torch.long), torch.tensor(positions), torch.tensor(slots), seqs,
                             torch.arange(0), decode_rows=3)
        selector.prepare(0, ctx, None, None, torch.randint(-4, 5, (at, 3), generator=g).float(), cache)

    step([(0, 4, 3), (1, 2, 2), (2, 4, 3)])  # r1's rows are the step's rows 3 and 4
    first = selector._holders[0][0]
    step([(0, 6, 2), (2, 6, 2)])
    latest, holders = selector._holders[0]
    assert holders == {"r0", "r2"} and latest.own_lo.shape[0] == 4
    (_, _, length, own, row), = selector._last["r1"][0]
    assert own is not first and (own.own_lo.shape[0], row, length) == (2, 0, 3)
    assert all(torch.equal(mine, theirs[3:5]) for mine, theirs in zip(own, first))
    selector.check_integrity({"r0", "r1", "r2"})
    selector._last["r1"][0] = [(p, s, n, Kept(*first), r + 3) for p, s, n, _, r in selector._last["r1"][0]]
    with pytest.raises(AssertionError, match="rows of an earlier step"):
        selector.check_integrity({"r0", "r1", "r2"})
    for request_id in ("r0", "r1", "r2"):
        selector.forget(request_id)
    assert selector._holders == {} and selector._last == {}


@pytest.mark.parametrize("kv_cache_dtype, dtype", [("auto", torch.float32), ("auto", torch.bfloat16),
                                                   ("fp8", torch.float32), ("fp8", torch.bfloat16)],
                         ids=["auto-fp32", "auto-bf16", "fp8-fp32", "fp8-bf16"])
def test_quest_page_bounds_upper_bound_every_true_score(kv_cache_dtype, dtype):
    """Property over random pages: for random queries, the bound Quest scores a page with is at least
    q . k for every head and every key of the page, k as attention reads it back from the cache (FP8
    rounded with kv_cache_dtype fp8); so is each row's own-page bound, over its page up to itself.
    Pages of 1 to 16 positions (one position: the bound is the score itself), placed anywhere in the
    pool, the last one partial; keys with per-dimension scales spread over e^+-3."""
    from types import SimpleNamespace
    from sparsekv.cache.latent_format import latent_format
    from sparsekv.context import SeqSlice
    from sparsekv.model.selectors import QuestSelector
    from tolerances import gamma
    cfg = SimpleNamespace(latent_dim=72, kv_lora_rank=64, qk_rope_head_dim=8)
    fmt, pool_pages = latent_format(kv_cache_dtype, cfg, dtype), 8
    for trial in range(40):
        gen = torch.Generator().manual_seed(trial)
        pt = (1, 2, 4, 16)[trial % 4]
        n = int(torch.randint(1, pool_pages * pt + 1, (1,), generator=gen))
        physical = torch.randperm(pool_pages, generator=gen)[:-(-n // pt)]
        positions = torch.arange(n)
        slots = physical[positions // pt] * pt + positions % pt
        latents = (torch.randn(n, 72, generator=gen) * torch.randn(72, generator=gen).exp()).to(dtype)
        quest = QuestSelector(cfg, pool_pages * pt, pt, "cpu", [0])
        seq = SeqSlice("r", 0, n, n, slots)
        ctx = SimpleNamespace(slot_mapping=slots, seqs=[seq], decode_rows=1, request_start=None)
        own_lo, own_hi = quest.prepare(0, ctx, None, None, latents, SimpleNamespace(fmt=fmt))
        keys = fmt.decode(fmt.encode(latents)).double()  # what attention reads, not as_stored's word for it
        q = torch.randn(n, 4, 72, generator=gen)         # [S, H, D]: one query row per position
        true = torch.einsum("shd,td->sht", q.double(), keys).amax(1)  # [S, T], the best head
        # the bound is float32: q's positive and negative parts' dot products over D = 72 dims and
        # their sum, below the exact bound by at most gamma_(D+1) of its terms' magnitudes, and those
        # exceed sum |q_i k_i| only by what the exact bound has to spare (tests/tolerances.py: gamma)
        slack = gamma(cfg.latent_dim + 1) * torch.einsum("shd,td->sht", q.double().abs(), keys.abs()).amax(1)
        bound = quest.page_scores(0, seq, q).double()     # [S, pages]
        for page in range(bound.shape[1]):
            keys_of_page = slice(page * pt, min(n, (page + 1) * pt))
            assert (bound[:, page:page + 1] >= (true - slack)[:, keys_of_page]).all(), (trial, page)
        own = quest._bound(q, own_lo[:, :, None], own_hi[:, :, None]).squeeze(-1).double()  # [S]
        for row in range(n):
            mine = slice(row - row % pt, row + 1)
            assert (own[row] >= (true - slack)[row, mine]).all(), (trial, row)


@pytest.mark.parametrize("keys_major_from", [None, 45], ids=["short-histories", "keys-major-from-45"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=TOPK),
                                     dict(kv_tiering=True, indexer_key_dtype="fp8_e4m3")],
                         ids=["device", "tiered", "tiered-fp8"])
def test_batched_decode_selection_equals_per_request(ckpt, options, keys_major_from, monkeypatch):
    """Accelerators select a step's one-row decodes in one batched pass over padded key histories
    (DSASelector.batch_decode). Forced on here: the same tokens and logprobs as per request, bit for
    bit on this CPU, through both pools and FP8 keys, and it really ran. With the keys-major threshold
    at 45 keys the prompts of 39 and 23 tokens cross it while decoding and the one of 60 starts past it,
    so steps batch both scoring layouts (never mixed in one batch)."""
    from sparsekv.model import indexer
    from sparsekv.model.selectors import DSASelector
    if keys_major_from is not None:
        monkeypatch.setattr(indexer, "DECODE_KEYS_MAJOR_MIN_KEYS_CPU", keys_major_from)
    reference, _ = generate(ckpt["glm_moe_dsa"], **options)
    calls, real = [], DSASelector.select_group

    def spy(self, layer, seqs, state, q, positions, k, cache, major):
        calls.append((len(seqs), major))
        return real(self, layer, seqs, state, q, positions, k, cache, major)
    monkeypatch.setattr(DSASelector, "select_group", spy)
    monkeypatch.setattr(DSASelector, "batch_decode", True)
    outs, _ = generate(ckpt["glm_moe_dsa"], **options)
    assert_same(reference, outs)
    assert calls and max(n for n, _ in calls) == (len(PROMPTS) if keys_major_from is None else 3)
    assert {major for _, major in calls} == ({False} if keys_major_from is None else {False, True})


def test_batched_decode_groups_stay_within_the_budget():
    from types import SimpleNamespace
    from sparsekv.model.attention import _groups_within
    seqs = [SimpleNamespace(context_len=n) for n in (10, 20, 30, 40, 100)]
    groups = _groups_within(seqs, 90)
    assert [[s.context_len for s in g] for g in groups] == [[10, 20, 30], [40], [100]]
    assert all(len(g) * g[-1].context_len <= 90 or len(g) == 1 for g in groups)


def test_batched_decode_groups_close_before_the_request_that_would_pass_the_budget():
    """A group's padded size counts the request being added: 10 and 20 fit 60 as a pair (2 x 20),
    but adding 25 would make 3 x 25 = 75 > 60 even though the two already grouped pad to 2 x 25 = 50."""
    from types import SimpleNamespace
    from sparsekv.model.attention import _groups_within
    seqs = [SimpleNamespace(context_len=n) for n in (10, 20, 25)]
    groups = _groups_within(seqs, 60)
    assert [[s.context_len for s in g] for g in groups] == [[10, 20], [25]]
    assert all(len(g) * g[-1].context_len <= 60 for g in groups)


def test_shared_layers_replay_the_decode_plan_without_reading_selections(ckpt, monkeypatch):
    """A decode step reads its selections to the host once per full layer; the IndexShare shared
    layers reuse that plan (on an accelerator: one synchronisation per full layer, not per layer)."""
    from sparsekv.cache.tiers import TieredKVPool
    decoding, read_by, real_decode, real_gather = [], [], TieredKVPool.gather_decode_latents, TieredKVPool._gather

    def decode_spy(self, layer, picks):
        decoding.append(layer)
        try:
            return real_decode(self, layer, picks)
        finally:
            decoding.pop()

    def gather_spy(self, layer, seqs, positions):
        if decoding:
            read_by.append(layer)
        return real_gather(self, layer, seqs, positions)
    reference, _ = generate(ckpt["glm_moe_dsa"])
    monkeypatch.setattr(TieredKVPool, "gather_decode_latents", decode_spy)
    monkeypatch.setattr(TieredKVPool, "_gather", gather_spy)
    outs, llm = generate(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=2 * TOPK)
    assert_same(reference, outs)
    assert set(read_by) == set(llm.engine.model_config.full_layers)


def test_bench_tiers_teacher_forced_natural_continuation(tmp_path):
    """--teacher-forced feeds the prompt file's own next tokens: the run is exact and its steps are
    the file's tokens (the FP8 pass is forced on the same sequence); a file too short is an error."""
    from sparsekv.input_processor import load_tokenizer
    from sparsekv.paths import default_model_path
    from sparsekv.tools.bench_tiers import main, parse_args
    from sparsekv.tools.bench_tiers_natural import _prompt
    model = default_model_path()
    text = tmp_path / "prompt.py"
    text.write_text(open(json.__file__).read())
    ids = load_tokenizer(model).encode(text.read_text(), add_special_tokens=False)
    args = parse_args(["--prompt-file", str(text), "--natural-context", "300",  # no --model: the bundled one
                       "--natural-steps", "12", "--teacher-forced"])
    assert _prompt(args, model, 0) == (ids[:300], ids[300:312])
    out = tmp_path / "forced.json"
    assert main(["--skip-sweep", "--prompt-file", str(text), "--natural-context", "300",
                 "--natural-steps", "12", "--warmup", "2", "--buffers", "2", "--teacher-forced",
                 "--json", str(out)]) == 0
    natural = json.loads(out.read_text())["natural"]
    assert natural["teacher_forced"] and natural["exact"] and natural["prompt_tokens"] == 300
    with pytest.raises(SystemExit, match="needs 1000000 tokens"):
        _prompt(parse_args(["--model", model, "--prompt-file", str(text), "--natural-context", "999990",
                            "--natural-steps", "10", "--teacher-forced"]), model, 0)
    with pytest.raises(SystemExit, match="needs --prompt-file"):
        _prompt(parse_args(["--teacher-forced"]), model, 1000)


def test_distinct_positions_equals_torch_unique():
    from sparsekv.cache.pool import distinct_positions
    flat = torch.randint(0, 500, (3000,), generator=torch.Generator().manual_seed(0))
    distinct, inverse = distinct_positions(flat, 500)
    want, want_inverse = torch.unique(flat, return_inverse=True)
    assert torch.equal(distinct, want) and torch.equal(inverse, want_inverse)
    assert torch.equal(distinct[inverse], flat)


def test_the_first_decode_step_starts_warm(monkeypatch):
    """The prompt's last row's selections are placed in the working set during the prefill (from rows
    it read anyway), so the bundled model's first decode step misses far fewer entries than with an
    empty working set; outputs are the same either way (placement never changes values)."""
    from sparsekv.cache.tiers import TieredKVPool
    from sparsekv.paths import default_model_path
    from sparsekv.tools.bench_kv_dtype import default_text

    def first_decode_misses():
        llm = LLM(default_model_path(), kv_tiering=True, max_model_len=1024, enable_prefix_caching=False)
        engine = llm.engine
        prompt = engine.tokenizer.encode(default_text())[:600]  # past top-k (256): the sparse regime
        req = engine.add_request(None, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while req.is_prefilling or not req.output_token_ids:
            engine.step()
        before = engine.stats()["tier_misses"]
        engine.step()
        misses = engine.stats()["tier_misses"] - before
        while engine.has_unfinished_requests():
            engine.step()
        assert_back_to_initial(engine)
        return misses, list(req.output_token_ids)
    warm, tokens = first_decode_misses()
    monkeypatch.setattr(TieredKVPool, "_prime", lambda *args: None)
    cold, cold_tokens = first_decode_misses()
    assert cold > 250 * 5  # nearly every one of the 256 selected positions, in each of the 5 layers
    assert warm < cold / 4 and tokens == cold_tokens


def test_a_decode_reads_its_working_set_rows_in_the_order_asked_for(ckpt, monkeypatch):
    """`gather_latent` returns the selected positions' latents "in the order asked for", through the
    working set too: a decode row's selections asked for in descending order (selectors give them
    ascending) read the same rows, reversed, and the outputs stay bit-identical to tiering off."""
    from sparsekv.cache.tiers import TieredKVPool
    real, compared = TieredKVPool.gather_decode_latents, []

    def gather_decode_latents(self, layer, picks):
        (seq,) = picks.seqs
        if self.leader[layer] != layer or layer in self.mtp_layers or seq.num_new_tokens != 1:
            return real(self, layer, picks)
        backwards = self.gather_latent(layer, seq, picks.selected.reshape(1, -1).flip(-1))
        got = real(self, layer, picks)  # the same positions ascending: the plan its shared layers replay
        compared.append(torch.equal(backwards.flip(1), got))
        return got
    prompt = PROMPTS[:1]
    reference, _ = generate(ckpt["glm_moe_dsa"], prompt)
    monkeypatch.setattr(TieredKVPool, "gather_decode_latents", gather_decode_latents)
    outs, _ = generate(ckpt["glm_moe_dsa"], prompt, kv_tiering=True, device_buffer_tokens=TOPK)
    assert compared and all(compared)
    assert_same(reference, outs)


def test_a_decode_asking_again_for_its_selections_finds_them_all_in_its_working_set(ckpt, monkeypatch):
    """`gather_latent` of a decode resolves through its working set (module docstring, step 3), as the
    batched read does: right after a full layer's decode read, the same positions asked for again are
    the same rows, every one a hit for each layer of the group, with no host -> device bytes."""
    from sparsekv.cache.tiers import TieredKVPool
    real, seen = TieredKVPool.gather_decode_latents, []

    def gather_decode_latents(self, layer, picks):
        got = real(self, layer, picks)
        (seq,) = picks.seqs
        if self.leader[layer] == layer and layer not in self.mtp_layers and seq.num_new_tokens == 1:
            before = self.request_counters(seq.request_id)
            again = self.gather_latent(layer, seq, picks.selected.reshape(1, -1))
            after = self.request_counters(seq.request_id)
            seen.append((torch.equal(again.view_as(got), got), after["h2d_bytes"] - before["h2d_bytes"],
                         after["tier_misses"] - before["tier_misses"],
                         after["tier_hits"] - before["tier_hits"] - picks.selected.numel() * len(self.groups[layer])))
        return got
    monkeypatch.setattr(TieredKVPool, "gather_decode_latents", gather_decode_latents)
    generate(ckpt["glm_moe_dsa"], PROMPTS[:1], kv_tiering=True, device_buffer_tokens=TOPK)
    assert seen and set(seen) == {(True, 0, 0, 0)}


def test_a_new_position_that_several_draft_rows_select_is_counted_once(ckpt, monkeypatch):
    """A decode with drafts resolves the union of its rows' selections: a position two rows select is
    one lookup, the step's new token included, even where the rows' older positions come ascending
    across the rows. Asked, in a decode step, for 2 rows selecting older positions 0, 1 then 2, 3 and
    the new token both (layer 3, a full layer with no shared layer), the request counts 5 lookups."""
    import dataclasses
    from sparsekv.cache.tiers import TieredKVPool
    real, counted = TieredKVPool.gather_decode_latents, []

    def gather_decode_latents(self, layer, picks):
        got = real(self, layer, picks)
        (seq,) = picks.seqs
        if layer == 3 and self.groups[layer] == [3] and seq.num_new_tokens == 1:
            drafts = dataclasses.replace(seq, token_start=seq.token_start - 1)  # 2 rows: a draft's too
            new = seq.first_new_position
            before = self.request_counters(seq.request_id)
            self.gather_latent(layer, drafts, torch.tensor([[0, 1, new], [2, 3, new]]))
            after = self.request_counters(seq.request_id)
            counted.append(after["tier_hits"] + after["tier_misses"] - before["tier_hits"] - before["tier_misses"])
        return got
    monkeypatch.setattr(TieredKVPool, "gather_decode_latents", gather_decode_latents)
    generate(ckpt["glm_moe_dsa"], PROMPTS[:1], kv_tiering=True, device_buffer_tokens=TOPK)
    assert counted and set(counted) == {5}


def test_dense_decode_latents_of_a_decode_and_a_request_without_a_working_set_reads_each_where_it_is(ckpt, monkeypatch):
    """`dense_decode_latents` resolves the requests as one group only when all of them use a working set;
    with one that does not (here the decode's own history under another request id) each is read where
    it is, the decode through its working set and the other from the host store: the same rows."""
    import dataclasses
    from sparsekv.cache.tiers import TieredKVPool
    real, compared = TieredKVPool.dense_decode_latents, []

    def dense_decode_latents(self, layer, seqs, length):
        got = real(self, layer, seqs, length)
        if len(seqs) == 1 and self.leader[layer] == layer and layer not in self.mtp_layers:
            other = dataclasses.replace(seqs[0], request_id="not-decoding")
            both = real(self, layer, [seqs[0], other], length)
            self.release(other.request_id)  # the counters its host read made
            compared.append(torch.equal(both[0], got[0]) and torch.equal(both[1], got[0]))
        return got
    monkeypatch.setattr(TieredKVPool, "dense_decode_latents", dense_decode_latents)
    generate(ckpt["glm_moe_dsa"], PROMPTS[1:2], kv_tiering=True, device_buffer_tokens=TOPK)
    assert compared and all(compared)


def test_a_host_fetch_outside_inference_mode_reuses_the_buffer_a_forward_grew():
    """A decode step's forward (inference mode) grows the link's reused staging buffer; a fetch outside
    inference mode (a transferred tail warming a working set, in begin_step) then writes into it. It
    must stay a normal tensor: writing an inference tensor outside inference mode raises, and that
    killed a tiered decode worker's engine."""
    from sparsekv.cache.host_store import HostLink, RamTieredHostStore
    host = RamTieredHostStore([0, 1], num_slots=64, dim=8, dtype=torch.float32)
    for layer in (0, 1):
        host.write(layer, torch.arange(64), torch.arange(64 * 8, dtype=torch.float32).view(64, 8) + layer)
    link = HostLink(host, torch.device("cpu"))
    dst = {layer: torch.zeros(16, 8) for layer in (0, 1)}
    with torch.inference_mode():
        link.fetch([0, 1], torch.arange(16), dst, torch.arange(16))  # grows the buffer to 16 rows
    src = torch.tensor([5, 9, 63])
    link.fetch([0, 1], src, dst, torch.tensor([0, 1, 2]))  # reuses it, outside inference mode
    for layer in (0, 1):
        assert torch.equal(dst[layer][:3], host.read(layer, src))


def test_a_host_fetch_larger_than_any_before_grows_the_reused_buffer():
    """The link's staging buffer grows to the largest fetch: a fetch of more rows than every earlier one
    reads into a buffer of its size (no out= tensor resized under it, which torch warns about) and
    lands every row."""
    import warnings
    from sparsekv.cache.host_store import HostLink, RamTieredHostStore
    host = RamTieredHostStore([0, 1], num_slots=64, dim=8, dtype=torch.float32)
    for layer in (0, 1):
        host.write(layer, torch.arange(64), torch.arange(64 * 8, dtype=torch.float32).view(64, 8) + layer)
    link = HostLink(host, torch.device("cpu"))
    dst = {layer: torch.zeros(16, 8) for layer in (0, 1)}
    link.fetch([0, 1], torch.tensor([3, 4]), dst, torch.tensor([0, 1]))
    src = torch.arange(40, 56)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        link.fetch([0, 1], src, dst, torch.arange(16))
    for layer in (0, 1):
        assert torch.equal(dst[layer], host.read(layer, src))


def test_emulated_backups_land_once_at_flush_and_reads_see_them(monkeypatch):
    """With CUDA's ordering emulated, a backup reaches the host store at the next `flush()` (or a
    link read, which flushes first), in issue order, and only once: a row written to the store after
    that flush (a prefix-cache page copied in, a slot reused) is never overwritten by an old backup."""
    from sparsekv.cache.host_store import HostLink, RamTieredHostStore
    monkeypatch.setattr(HostLink, "emulate_async", True)
    host = RamTieredHostStore([0], num_slots=8, dim=2, dtype=torch.float32)
    host.write(0, torch.arange(8), torch.zeros(8, 2))
    link = HostLink(host, torch.device("cpu"))
    link.backup(0, torch.tensor([1, 2]), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    link.backup(0, torch.tensor([2]), torch.tensor([[3.0, 3.0]]))       # a later write of slot 2 wins
    assert torch.equal(host.read(0, torch.tensor([1, 2])), torch.zeros(2, 2))  # not landed yet
    assert torch.equal(link.read(0, torch.tensor([1, 2])), torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    host.write(0, torch.tensor([1]), torch.tensor([[7.0, 7.0]]))
    link.flush()
    assert torch.equal(host.read(0, torch.tensor([1, 2])), torch.tensor([[7.0, 7.0], [3.0, 3.0]]))


def test_an_emulated_fetch_lands_each_shared_layers_rows_only_at_its_wait(monkeypatch):
    """With CUDA's ordering emulated, a fetch for a group lands the first layer's rows at once (the
    current stream) and every other layer's (the side stream) only at that layer's `wait`, the second
    layer's as late as the third's."""
    from sparsekv.cache.host_store import HostLink, RamTieredHostStore
    monkeypatch.setattr(HostLink, "emulate_async", True)
    host = RamTieredHostStore([0, 1, 2], num_slots=8, dim=2, dtype=torch.float32)
    for layer in (0, 1, 2):
        host.write(layer, torch.arange(8), torch.arange(16, dtype=torch.float32).view(8, 2) + 100 * layer)
    link = HostLink(host, torch.device("cpu"))
    dst = {layer: torch.zeros(4, 2) for layer in (0, 1, 2)}
    src, rows = torch.tensor([5, 6]), torch.tensor([0, 3])
    link.fetch([0, 1, 2], src, dst, rows)
    landed = lambda layer: torch.equal(dst[layer][rows], host.read(layer, src))  # noqa: E731
    assert landed(0) and not dst[1].any() and not dst[2].any()
    link.wait(1)
    assert landed(1) and not dst[2].any()
    link.wait(2)
    assert landed(2)


def test_an_emulated_backup_lands_the_rows_as_they_were_when_it_was_issued(monkeypatch):
    """A backup copies its rows when issued (CUDA: into pinned staging on the backup stream), so a
    device buffer reused before the flush (the next layer's, the next step's) does not change what
    lands: the emulation keeps that too, or a caller relying on it would pass here and fail on a GPU."""
    from sparsekv.cache.host_store import HostLink, RamTieredHostStore
    monkeypatch.setattr(HostLink, "emulate_async", True)
    host = RamTieredHostStore([0], num_slots=4, dim=2, dtype=torch.float32)
    host.write(0, torch.arange(4), torch.zeros(4, 2))
    link = HostLink(host, torch.device("cpu"))
    slots, values = torch.tensor([1, 3]), torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    link.backup(0, slots, values)
    slots.copy_(torch.tensor([0, 2]))
    values.fill_(9.0)                                                    # the buffers reused
    link.flush()
    assert torch.equal(host.read(0, torch.arange(4)), torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [3.0, 3.0]]))


def test_a_pinned_host_store_is_page_locked_in_place_at_its_own_size(monkeypatch):
    """On CUDA the host store is page-locked (for asynchronous copies) with cudaHostRegister over its own
    bytes, and unlocked at close: torch's pinned allocator would round it up to a power of two (a 33 GiB
    store locking 64 GiB), past what the tiered cache's size check counted. A stand-in cudart records
    the calls (this machine has no CUDA)."""
    from sparsekv.cache.host_store import RamTieredHostStore
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    store = RamTieredHostStore([0, 2, 3], num_slots=100, dim=24, dtype=torch.float32, pin=True)
    first = store.slot_tensors()[0][0]
    assert calls == [("register", first.data_ptr(), 3 * 100 * 24 * 4, 1)]
    store.close()
    assert calls[1:] == [("unregister", first.data_ptr())]
    RamTieredHostStore([0], num_slots=4, dim=2, dtype=torch.float32).close()  # off CUDA: nothing locked
    assert len(calls) == 2


def test_tier_check_integrity_catches_state_kept_for_a_request_that_left(ckpt):
    """TieredKVPool.check_integrity (which the engine's runs): a working set or tier counters kept for a
    request neither running nor waiting is a leak, and fires; a preempted (waiting) request's kept
    counters do not, and the check passes again once they are let go."""
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK)
    engine, pool = llm.engine, llm.engine.kv.pool
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while not pool.has_working_set("a"):
        engine.step()
    pool.check_integrity({"a"}, set())
    with pytest.raises(AssertionError, match=r"tier state kept for finished requests \['a'\]"):
        pool.check_integrity(set(), set())  # its working set
    pool.release("a", keep_counters=True)  # as a preemption does
    pool.check_integrity(set(), {"a"})
    with pytest.raises(AssertionError, match=r"tier state kept for finished requests \['a'\]"):
        pool.check_integrity(set(), set())  # its counters
    pool.release("a")
    pool.check_integrity(set(), set())
    pool._count("ghost", hits=1)  # the engine's check runs the pool's: counters of a request it does not know
    with pytest.raises(AssertionError, match=r"tier state kept for finished requests \['ghost'\]"):
        engine.check_integrity()
    pool.release("ghost")
    engine.check_integrity()
    engine.abort("a")
    assert_back_to_initial(engine)


def test_tier_check_integrity_catches_a_working_set_owned_by_two_requests(ckpt):
    """Two requests holding the same device buffer would overwrite each other's working-set rows: the
    check names that, not only the allocator's count."""
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK)
    engine, pool = llm.engine, llm.engine.kv.pool
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while not pool.has_working_set("a"):
        engine.step()
    pool._resident["b"] = pool._resident["a"]
    with pytest.raises(AssertionError, match="a working set is owned by two requests"):
        pool.check_integrity()
    del pool._resident["b"]
    pool.check_integrity({"a"})
    engine.abort("a")
    assert_back_to_initial(engine)


def test_the_tiered_size_check_counts_what_the_pool_holds(ckpt, monkeypatch):
    """The memory check before the pool is made (`check_tiered_fits`) is given the host bytes and the
    device bytes the pool then holds: every working set's rows, the new-token rows included, and the
    indexer keys of every slot."""
    from sparsekv.cache import tiers
    checked, real = [], tiers.check_tiered_fits

    def check(host_bytes, device_bytes, *args):
        checked.append((host_bytes, device_bytes))
        return real(host_bytes, device_bytes, *args)
    monkeypatch.setattr(tiers, "check_tiered_fits", check)
    pool = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK).engine.kv.pool
    device = pool.buffers.num_pages * pool.working_set_bytes() + pool.num_slots * pool.selector_bytes_per_token
    assert checked == [(pool.num_slots * pool.latent_bytes_per_token(), device)]


def test_a_warm_up_whose_union_exactly_fills_the_working_set_places_it_whole(ckpt):
    """`_warm` places a transferred tail's union of selections "when it fits", N of them included, then
    the last row's: with N = TOPK and a union of TOPK positions, a fresh working set holds every one of
    them, in each layer of the group the rows its host store holds, counted as warmed per layer."""
    from types import SimpleNamespace

    import numpy as np
    llm = make(ckpt["glm_moe_dsa"], kv_tiering=True, device_buffer_tokens=TOPK)
    engine, pool = llm.engine, llm.engine.kv.pool
    req = engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while req.is_prefilling:
        engine.step()
    pool.flush()
    union, last = tuple(range(TOPK)), (TOPK - 3, TOPK - 2, TOPK - 1)
    ws = pool._working_set("w")  # a fresh working set over request a's pages
    pool._warm(SimpleNamespace(request_id="w", page_ids=list(req.page_ids), warm=((0, union, last),)))
    slots = ws.lrus[0].slots_of(np.arange(len(PROMPTS[0])))
    assert np.flatnonzero(slots >= 0).tolist() == list(union)
    base, page = pool._base(ws), pool.page_size
    host_slots = torch.tensor([req.page_ids[p // page] * page + p % page for p in union])
    for layer in pool.groups[0]:
        stored = pool.host.read(layer, host_slots)
        assert torch.equal(pool.ws[layer][base + torch.from_numpy(slots[:TOPK])], stored)
    assert pool.request_counters("w")["tier_warmed"] == TOPK * len(pool.groups[0])
    pool.release("w")
    while engine.has_unfinished_requests():
        engine.step()
    assert_back_to_initial(engine)
