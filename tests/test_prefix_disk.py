"""The prefix cache's disk tier (cache/prefix_disk.py): pages pushed out of host memory written to
files, read back exactly, kept across restarts, scoped to the model and its settings, per tenant."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from sparsekv import ConfigError, SamplingParams
from sparsekv.tools.tiny import save_reference_checkpoint
from test_prefix_cache import BASE, GREEDY, OTHERS, PAGE, PROMPTS, _evict_then_hit, assert_close, assert_idle, make

DISK = 1 << 24
SMALL_POOL = dict(num_kv_pages=12, max_num_seqs=1, prefill_chunk_tokens=PAGE)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prefix-disk"))
    save_reference_checkpoint(path, family="glm_moe_dsa", seed=1, index_topk=8)
    return path


def disk_engine(ckpt, root, host_pages=2, **options):
    """A pool of 12 pages, a host tier of `host_pages` pages (0: none), the disk tier under `root`."""
    model_options = {k: v for k, v in options.items() if not k.startswith("prefix_cache")}
    host = {"prefix_cache_host_bytes": host_pages * _page_bytes(ckpt, **model_options)} if host_pages else {}
    return make(ckpt, enable_prefix_caching=True, prefix_cache_disk_path=str(root), prefix_cache_disk_bytes=DISK,
                **host, **SMALL_POOL, **options)


def _page_bytes(ckpt, **options):
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, **SMALL_POOL, **options)
    return llm.engine.kv.prefix.tiers["host"].page_bytes


def _file_bytes(ckpt, sealed=True):
    """The size of one page file (metadata included): the disk budget's unit."""
    from sparsekv.cache.page_cipher import PageCipher
    from sparsekv.cache.prefix_disk import page_file_bytes
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, **SMALL_POOL)
    return page_file_bytes(llm.engine.kv.prefix.tiers["host"].rows, PageCipher(b"k" * 32, "space") if sealed else None)


def _files(root):
    return sorted(f for _, _, names in os.walk(root) for f in names if f.endswith(".safetensors"))


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=8, host_kv_budget_bytes=12 * PAGE * 640)],
                         ids=["device", "tiered"])
@pytest.mark.parametrize("host_pages", [2, 0], ids=["host+disk", "disk only"])
def test_pages_pushed_out_of_host_memory_come_back_from_disk_exactly(ckpt, tmp_path, options, host_pages,
                                                                     emulated_cuda):
    """A host tier of 2 pages spills to disk (or, without a host tier, the pool evicts straight to
    disk); hits read the files back: outputs equal no cache bit for bit, hits counted by tier."""
    small = dict(SMALL_POOL, **options)
    if options.get("kv_tiering"):
        small.pop("num_kv_pages")
    want = [make(ckpt, **small).generate([p], GREEDY)[0] for p in PROMPTS[:3]]
    llm = disk_engine(ckpt, tmp_path, host_pages=host_pages, **options)
    got = _evict_then_hit(llm, PROMPTS[:3])
    assert_close(want, got, bitwise=True)
    stats = llm.stats()
    assert stats["prefix_cache_hits_disk"] == sum(o.metrics["prefix_cached_tokens_disk"] for o in got) >= 64
    for out in got:
        assert sum(out.metrics[f"prefix_cached_tokens_{t}"] for t in ("device", "host", "disk")) == out.num_cached_tokens
    llm.engine.kv.prefix.tiers["disk"].flush()  # the background writes, done
    assert stats["prefix_disk_pages"] > 0 and len(_files(tmp_path)) == stats["prefix_disk_pages"]
    assert_idle(llm)
    llm.close()


def test_the_disk_tier_survives_a_restart_and_keeps_tenants_apart(ckpt, tmp_path):
    """Closing saves the pool's and host tier's pages to disk; a new engine on the same directory
    serves a repeated prompt from there, exactly, for the same tenant only."""
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    with disk_engine(ckpt, tmp_path) as first:
        first.engine.add_request("a", BASE + [3], GREEDY, tenant="alice")
        while first.engine.has_unfinished_requests():
            first.engine.step()
        assert first.stats()["prefix_disk_pages"] == 0  # nothing pushed out yet: all saved at close
    assert len(_files(tmp_path)) == 5  # 82 computed tokens: 5 full pages
    second = disk_engine(ckpt, tmp_path).engine
    assert second.stats()["prefix_disk_pages"] == 5
    outs = {}
    for rid, tenant in (("bob", "bob"), ("alice", "alice")):
        second.add_request(rid, PROMPTS[0], GREEDY, tenant=tenant)
        while second.has_unfinished_requests():
            outs.update({o.request_id: o for o in second.step() if o.finished})
    assert outs["bob"].num_cached_tokens == 0                      # another tenant: nothing found
    assert outs["alice"].metrics["prefix_cached_tokens_disk"] == 64
    assert_close([want, want], [outs["alice"], outs["bob"]], bitwise=True)
    second.close()


def test_another_checkpoint_or_setting_never_reads_the_pages(ckpt, tmp_path, tmp_path_factory):
    """The directory is scoped by a hash of the checkpoint and of every setting that changes a page's
    bytes: another model, or the same one with Quest selection, finds nothing."""
    with disk_engine(ckpt, tmp_path) as llm:
        llm.generate([BASE + [3]], GREEDY)
    other = str(tmp_path_factory.mktemp("other-model"))
    save_reference_checkpoint(other, family="glm_moe_dsa", seed=2, index_topk=8)  # same shapes, other weights
    for path, options in ((other, {}), (ckpt, dict(selector="quest")), (ckpt, dict(dtype="bfloat16"))):
        with disk_engine(path, tmp_path, **options) as llm:
            assert llm.stats()["prefix_disk_pages"] == 0, options
            assert llm.generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 0
    with disk_engine(ckpt, tmp_path) as llm:  # the original settings still find theirs
        assert llm.generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 64
    assert len([e for e in os.scandir(tmp_path) if e.is_dir()]) == 4


def test_a_weights_file_rewritten_in_place_is_another_checkpoint(ckpt, tmp_path, tmp_path_factory):
    """A file rewritten where no sampled block looks (a partial update in place) keeps its size and
    samples but not its modification time: its pages are never read under the new weights."""
    import shutil
    copy = str(tmp_path_factory.mktemp("rewritten"))
    shutil.copytree(ckpt, copy, dirs_exist_ok=True, copy_function=shutil.copy2)  # times kept: the same checkpoint
    with disk_engine(copy, tmp_path) as llm:
        llm.generate([BASE + [3]], GREEDY)
    with disk_engine(copy, tmp_path) as llm:
        assert llm.generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 64
    weights = os.path.join(copy, "model.safetensors")
    os.utime(weights, ns=(os.stat(weights).st_atime_ns, os.stat(weights).st_mtime_ns + 10 ** 9))
    with disk_engine(copy, tmp_path) as llm:
        assert llm.stats()["prefix_disk_pages"] == 0
        assert llm.generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 0


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_are_private_and_the_budget_holds(ckpt, tmp_path):
    """The tier's directory (made by the engine) and its namespace are 0700; pages, the lock, the
    generated key and the tenant key 0600, under the usual umask."""
    budget_pages, root = 3, tmp_path / "tier"
    umask = os.umask(0o022)
    try:
        llm = make(ckpt, enable_prefix_caching=True, prefix_cache_disk_path=str(root),
                   prefix_cache_disk_bytes=budget_pages * _file_bytes(ckpt), **SMALL_POOL)
    finally:
        os.umask(umask)
    _evict_then_hit(llm, [BASE + [9]])
    disk = llm.engine.kv.prefix.tiers["disk"]
    disk.flush()
    assert disk.num_pages <= budget_pages and disk.dropped > 0 and len(_files(root)) == disk.num_pages
    assert _mode(root) == _mode(disk.dir) == 0o700
    for name in _files(root) + [".lock", ".tenant-key"]:
        assert _mode(os.path.join(disk.dir, name)) == 0o600, name
    assert _mode(root / ".prefix-cache.key") == 0o600
    assert_idle(llm)
    llm.close()


def test_an_unreadable_page_is_recomputed_and_removed(ckpt, tmp_path):
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    with disk_engine(ckpt, tmp_path) as llm:
        llm.generate([BASE + [3]], GREEDY)
        page1 = llm.engine.kv.prefix.tiers["disk"].path_of(llm.engine.kv.prompt_chains([PROMPTS[0]])[0][1])
    disk_dir = os.path.dirname(page1)
    with open(page1, "r+b") as f:  # one page truncated, as a crash or a full disk might
        f.truncate(100)
    page1 = os.path.basename(page1)
    llm = disk_engine(ckpt, tmp_path)
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert_close([want], [out], bitwise=True)
    disk = llm.engine.kv.prefix.tiers["disk"]
    assert disk.failed == 1 and out.num_cached_tokens < 64
    assert llm.stats()["prefix_disk_failures"] == 1 and llm.stats()["prefix_disk_reads"] == disk.loaded
    disk.flush()
    assert page1 not in os.listdir(disk_dir)
    assert_idle(llm)
    llm.close()


def test_every_unreadable_page_of_a_chain_is_removed_and_saved_anew(ckpt, tmp_path):
    """Every page file truncated: the reads ahead find each unreadable, also those after the first that
    fails (no admission takes them), so each is counted and removed; the recomputed pages are then saved
    anew, and the next restart hits the whole prompt."""
    prompt = PROMPTS[0]
    want = make(ckpt, **SMALL_POOL).generate([prompt], GREEDY)[0]
    with disk_engine(ckpt, tmp_path, host_pages=0) as llm:
        llm.generate([prompt], GREEDY)
    disk_dir = next(e for e in os.scandir(tmp_path) if e.is_dir()).path
    pages = [n for n in os.listdir(disk_dir) if n.endswith(".safetensors")]
    assert len(pages) >= (len(prompt) - 1) // PAGE  # the prompt's full pages, and the output's
    for name in pages:
        with open(os.path.join(disk_dir, name), "r+b") as f:
            f.truncate(100)
    with disk_engine(ckpt, tmp_path, host_pages=0) as llm:
        out = llm.generate([prompt], GREEDY)[0]
        assert_close([want], [out], bitwise=True)
        disk = llm.engine.kv.prefix.tiers["disk"]
        disk.flush()
        assert out.num_cached_tokens == 0 and disk.failed == (len(prompt) - 1) // PAGE  # each read ahead
        chain = [disk.path_of(name) for name in llm.engine.kv.prompt_chains([prompt])[0]]
        assert not any(os.path.exists(path) for path in chain)  # removed; its recomputed pages are in the pool
        assert_idle(llm)
    assert all(os.path.getsize(path) > 100 for path in chain)  # saved anew at close
    with disk_engine(ckpt, tmp_path, host_pages=0) as llm:
        again = llm.generate([prompt], GREEDY)[0]
        assert_close([want], [again], bitwise=True)
        assert again.num_cached_tokens == (len(prompt) - 1) // PAGE * PAGE
        assert llm.engine.kv.prefix.tiers["disk"].failed == 0


def test_one_engine_per_directory_and_bad_options_are_refused(ckpt, tmp_path):
    llm = disk_engine(ckpt, tmp_path)
    with pytest.raises(ConfigError, match="in use by another engine"):
        disk_engine(ckpt, tmp_path)
    llm.close()
    disk_engine(ckpt, tmp_path).close()  # free again once closed
    for bad in (dict(prefix_cache_disk_path=str(tmp_path)), dict(prefix_cache_disk_bytes=DISK),
                dict(prefix_cache_disk_path=str(tmp_path), prefix_cache_disk_bytes=0)):
        with pytest.raises(ConfigError, match="prefix_cache_disk"):
            make(ckpt, enable_prefix_caching=True, **bad)
    with pytest.raises(ConfigError, match="prefix_cache_disk"):
        make(ckpt, enable_prefix_caching=False, prefix_cache_disk_path=str(tmp_path), prefix_cache_disk_bytes=DISK)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="prefix_cache_disk_path"):
        make(ckpt, enable_prefix_caching=True, prefix_cache_disk_path=str(blocker), prefix_cache_disk_bytes=DISK)


def test_an_engine_that_fails_to_build_lets_go_of_its_directory(ckpt, tmp_path):
    """An option found wrong after the cache is built (a tokenizer asked for and not there) fails the
    engine, and its disk tier's directory is free again at once: the retry with the option fixed is
    built, not refused as another engine's (LLMEngine closes what it started when its build fails)."""
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        disk_engine(ckpt, tmp_path / "tier", host_pages=0, tokenizer=str(empty))
    disk_engine(ckpt, tmp_path / "tier", host_pages=0).close()


def test_a_restart_keeps_the_most_recently_used_pages_within_a_smaller_budget(ckpt, tmp_path):
    """Pages are evicted least recently saved or hit first, and a restart keeps that order (file
    times): a new engine with room for 4 pages keeps BASE's, the ones hit last."""
    with disk_engine(ckpt, tmp_path, host_pages=0) as llm:
        for prompt in OTHERS:
            llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        llm.generate([BASE + [3]], GREEDY)
    with make(ckpt, enable_prefix_caching=True, prefix_cache_disk_path=str(tmp_path),
              prefix_cache_disk_bytes=4 * _file_bytes(ckpt), **SMALL_POOL) as llm:
        assert llm.stats()["prefix_disk_pages"] == 4
        assert llm.generate([PROMPTS[0]], GREEDY)[0].metrics["prefix_cached_tokens_disk"] == 64


def test_a_restarted_server_serves_the_prompt_from_disk(tmp_path):
    """The server saves the prefix cache to disk when it shuts down; the next server on the same
    directory reports the prompt's tokens as cached, and /metrics counts them under tier "disk"."""
    import openai

    from test_server_util import ThreadServer, scrape, tiny_checkpoint
    model = tiny_checkpoint(tmp_path)
    prompt = "the rain in spain falls mainly on the plain " * 8
    options = dict(enable_prefix_caching=True, prefix_cache_disk_path=str(tmp_path / "disk"),
                   prefix_cache_disk_bytes=DISK)
    texts, cached = [], []
    for _ in range(2):
        with ThreadServer(model, **options) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            texts.append(r.choices[0].text)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            hits = scrape(srv.url)["sparsekv:prefix_cache_hits_total"], srv.engine.stats()["prefix_cache_hits_disk"]
    assert cached[0] == 0 and cached[1] > 0 and texts[0] == texts[1]
    assert hits == (cached[1], cached[1])  # all from the disk tier


# -- retention (prefix_cache_ttl_s) -------------------------------------------------------------------
def test_pages_unused_for_the_ttl_are_forgotten_in_every_tier(ckpt, tmp_path):
    """With a 60 s retention: pages hit 40 s ago stay, pages last used 70 s ago are gone from the pool,
    the host tier and the disk tier (files removed); output stays equal to no cache throughout."""
    now = [1000.0]
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    llm = disk_engine(ckpt, tmp_path, prefix_cache_ttl_s=60)
    llm.engine.kv.prefix.set_clock(lambda: now[0])
    llm.generate([BASE + [3]], GREEDY)
    for prompt in OTHERS:  # BASE's pages are pushed to the host and disk tiers
        llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    now[0] += 30
    assert_close([want], llm.generate([PROMPTS[0]], GREEDY), bitwise=True)
    now[0] += 40  # BASE's pages were used 40 s ago, OTHERS' 70 s ago
    assert llm.engine.expire_prefix_cache() > 0
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.num_cached_tokens == 64
    now[0] += 61
    stats = llm.stats()
    assert llm.engine.expire_prefix_cache() == stats["prefix_cached_pages"] + stats["prefix_host_pages"] + \
        stats["prefix_disk_pages"] > 0
    stats = llm.stats()
    assert stats["prefix_cached_pages"] == stats["prefix_host_pages"] == stats["prefix_disk_pages"] == 0
    disk = llm.engine.kv.prefix.tiers["disk"]
    disk.flush()
    assert _files(tmp_path) == []
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert_close([want], [out], bitwise=True)
    assert llm.stats()["prefix_cache_expired_pages"] > 0
    assert_idle(llm)
    llm.close()


def test_a_restart_forgets_files_older_than_the_ttl(ckpt, tmp_path):
    import time
    with disk_engine(ckpt, tmp_path) as llm:
        llm.generate([BASE + [3]], GREEDY)
    assert len(_files(tmp_path)) == 5
    later = disk_engine(ckpt, tmp_path, prefix_cache_ttl_s=60)
    later.engine.kv.prefix.set_clock(lambda: time.time() + 120)  # the files were last used two minutes ago
    assert later.generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 0
    later.engine.kv.prefix.tiers["disk"].flush()
    assert _files(tmp_path) == [] and later.stats()["prefix_cache_expired_pages"] == 5
    later.close()


def test_an_idle_server_still_forgets_expired_pages(tmp_path):
    from test_server_util import ThreadServer, scrape, tiny_checkpoint, wait_until
    model = tiny_checkpoint(tmp_path)
    with ThreadServer(model, enable_prefix_caching=True, prefix_cache_ttl_s=0.5) as srv:
        import httpx
        httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "the rain in spain " * 10,
                                                      "max_tokens": 2}, timeout=30).raise_for_status()
        assert wait_until(lambda: scrape(srv.url)["sparsekv:prefix_cache_expired_pages_total"] > 0, timeout=10)
        assert scrape(srv.url)["sparsekv:prefix_cached_pages"] == 0
    with pytest.raises(ConfigError, match="prefix_cache_ttl_s"):
        make(model, enable_prefix_caching=True, prefix_cache_ttl_s=0)


# -- reset (vLLM's /reset_prefix_cache, per tenant) ---------------------------------------------------
def _fill_for(engine, tenant):
    """BASE for `tenant`, then two other prompts for "other" that push BASE's pages down the tiers."""
    for rid, prompt, who in (("base", BASE + [3], tenant), ("o1", OTHERS[0], "other"), ("o2", OTHERS[1], "other")):
        engine.add_request(f"{rid}-{tenant}", prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                                     ignore_eos=True), tenant=who)
        while engine.has_unfinished_requests():
            engine.step()


def _cached(engine, tenant):
    engine.add_request("probe", PROMPTS[0], GREEDY, tenant=tenant)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out.num_cached_tokens


def test_reset_forgets_one_tenants_pages_in_every_tier(ckpt, tmp_path):
    engine = disk_engine(ckpt, tmp_path).engine
    _fill_for(engine, "alice")
    disk = engine.kv.prefix.tiers["disk"]
    assert disk.num_pages > 0 and engine.stats()["prefix_host_pages"] > 0
    removed = engine.reset_prefix_cache("alice")
    assert removed == 5  # BASE's 5 full pages, wherever they were (pool, host or disk)
    assert _cached(engine, "alice") == 0
    others = engine.stats()["prefix_cache_by_tenant"]["other"]["cached_pages"]
    assert others > 0  # the other tenant's pages stay
    assert engine.reset_prefix_cache() > 0 and engine.stats()["prefix_cached_pages"] == 0  # everyone's
    assert engine.stats()["prefix_host_pages"] == disk.num_pages == 0
    disk.flush()
    assert _files(tmp_path) == []
    engine.check_integrity()
    engine.close()


def test_a_restarted_engine_still_resets_a_tenants_files(ckpt, tmp_path):
    """Files record a digest of their tenant (not its name), so a reset after a restart finds them."""
    with disk_engine(ckpt, tmp_path) as llm:
        _fill_for(llm.engine, "alice")
    files = len(_files(tmp_path))
    engine = disk_engine(ckpt, tmp_path).engine
    assert engine.reset_prefix_cache("alice") == 5
    engine.kv.prefix.tiers["disk"].flush()
    assert len(_files(tmp_path)) == files - 5
    assert not any("alice" in open(os.path.join(d, f), "rb").read(4096).decode("latin-1")
                   for d, _, names in os.walk(tmp_path) for f in names if f.endswith(".safetensors"))
    engine.close()


def test_the_reset_endpoint_is_scoped_to_the_callers_tenant(tmp_path):
    import httpx

    from test_server_util import ThreadServer, tiny_checkpoint
    model = tiny_checkpoint(tmp_path)
    prompt = {"model": "tiny", "prompt": "the rain in spain falls mainly on the plain " * 8, "max_tokens": 2}
    with ThreadServer(model, api_keys=["sk-a:alice", "sk-b:bob"], enable_prefix_caching=True) as srv:
        def post(path, key, body=None):
            return httpx.post(srv.url + path, json=body or {}, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        for key in ("sk-a", "sk-b"):
            post("/v1/completions", key, prompt).raise_for_status()
        reset = post("/reset_prefix_cache", "sk-a")
        assert reset.status_code == 200 and reset.json()["tenant"] == "alice" and reset.json()["pages_removed"] > 0
        cached = {key: post("/v1/completions", key, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for key in ("sk-a", "sk-b")}
        assert cached["sk-a"] == 0 and cached["sk-b"] > 0  # only alice's prompts were forgotten
        assert post("/reset_prefix_cache", "wrong").status_code == 401
        srv.engine.check_integrity()


def test_a_failed_write_drops_the_page_and_serving_goes_on(ckpt, tmp_path, monkeypatch):
    """A full disk: each write fails, is logged and counted, the page is forgotten (a later lookup
    computes it), and outputs stay equal to no cache."""
    import errno

    import sparsekv.cache.prefix_disk as prefix_disk

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    llm = disk_engine(ckpt, tmp_path, host_pages=0)
    monkeypatch.setattr(prefix_disk, "write_private_file", full)
    disk = llm.engine.kv.prefix.tiers["disk"]
    llm.generate([BASE + [3]], GREEDY)
    for prompt in OTHERS:  # evict BASE's pages: their writes fail
        llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    disk.flush()  # every write has failed by now (a page still being written would be read from memory)
    got = llm.generate([PROMPTS[0]], GREEDY)[0]
    disk.flush()
    stats = llm.stats()
    assert stats["prefix_disk_failures"] > 0 and stats["prefix_disk_pages"] == 0 and _files(tmp_path) == []
    assert got.metrics["prefix_cached_tokens_disk"] == 0
    assert_close([want], [got], bitwise=True)
    assert_idle(llm)
    llm.close()


# -- encryption at rest (prefix_cache_disk_key_file) ---------------------------------------------------
def _key(tmp_path, name="key", secret=b"k" * 40):
    path = tmp_path / name
    path.write_bytes(secret)
    path.chmod(0o600)
    return str(path)


def test_encrypted_pages_come_back_exactly_and_hold_no_plaintext(ckpt, tmp_path):
    """With a key file, each page file is AES-256-GCM ciphertext: none of the page's bytes appear in
    it, and a restarted engine with the same key serves the prompt from disk bit for bit."""
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    key = _key(tmp_path)
    disk_dir = tmp_path / "disk"
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=key) as llm:
        llm.generate([BASE + [3]], GREEDY)
        page = llm.engine.kv.prefix.tiers["disk"].rows.copy_out(llm.engine.kv.allocator.cached.pages()[0])
    plain_rows = page[0].contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:64]
    files = [os.path.join(d, f) for d, _, names in os.walk(disk_dir) for f in names if f.endswith(".safetensors")]
    assert len(files) == 5
    assert not any(plain_rows in open(f, "rb").read() for f in files)
    again = disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=key)
    out = again.generate([PROMPTS[0]], GREEDY)[0]
    assert out.metrics["prefix_cached_tokens_disk"] == 64
    assert_close([want], [out], bitwise=True)
    again.close()


def test_another_key_or_an_altered_file_reads_as_a_miss(ckpt, tmp_path):
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    disk_dir = tmp_path / "disk"
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=_key(tmp_path)) as llm:
        llm.generate([BASE + [3]], GREEDY)
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=_key(tmp_path, "other", b"z" * 40)) as llm:
        stats = llm.stats()  # the same namespace (the key is not part of it): its files are removed at start
        assert stats["prefix_disk_discarded"] == 5 and stats["prefix_disk_pages"] == 0 and _page_paths(disk_dir) == []
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.num_cached_tokens == 0 and llm.stats()["prefix_disk_failures"] == 0
        assert_close([want], [out], bitwise=True)
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_unencrypted=True) as llm:  # another namespace: nothing found
        assert llm.stats()["prefix_disk_pages"] == 0
    altered = tmp_path / "altered"
    with disk_engine(ckpt, altered, prefix_cache_disk_key_file=_key(tmp_path)) as llm:
        llm.generate([BASE + [3]], GREEDY)
    first = sorted(f for f in (os.path.join(d, n) for d, _, names in os.walk(altered) for n in names)
                   if f.endswith(".safetensors"))
    for path in first:  # one bit flipped near the end of every file: inside the ciphertext or its tag
        data = bytearray(open(path, "rb").read())
        data[-5] ^= 1
        open(path, "wb").write(bytes(data))
    with disk_engine(ckpt, altered, prefix_cache_disk_key_file=_key(tmp_path)) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.num_cached_tokens == 0 and llm.stats()["prefix_disk_failures"] == 4  # each page read ahead
        assert_close([want], [out], bitwise=True)
    with pytest.raises(ConfigError, match="at least 32"):
        disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=_key(tmp_path, "short", b"x" * 8))
    with pytest.raises(ConfigError, match="prefix_cache_disk_key_file"):
        make(ckpt, enable_prefix_caching=True, prefix_cache_disk_key_file=_key(tmp_path))


def _key_ids(disk_dir):
    from sparsekv.cache.prefix_disk import _header_metadata
    ids = []
    for d, _, names in os.walk(disk_dir):
        for n in names:
            if n.endswith(".safetensors"):
                with open(os.path.join(d, n), "rb") as f:
                    ids.append(_header_metadata(f.read(int.from_bytes(f.read(8), "little"))).get("key"))
    return ids


def test_rotating_the_key_reseals_every_page_and_keeps_the_hits(ckpt, tmp_path):
    """Pages sealed with key A; an engine with key B and A as an old key re-seals every file with B in
    the background (file times kept), serving hits meanwhile; then an engine with B alone still hits
    every page, bit for bit, and one with A alone misses them."""
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    old, new = _key(tmp_path, "a", b"a" * 40), _key(tmp_path, "b", b"b" * 40)
    disk_dir = tmp_path / "disk"
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=old) as llm:
        llm.generate([BASE + [3]], GREEDY)
        old_id = llm.engine.kv.prefix.tiers["disk"].cipher.key_id
    times = sorted(os.stat(os.path.join(d, n)).st_mtime_ns for d, _, ns in os.walk(disk_dir) for n in ns
                   if n.endswith(".safetensors"))
    assert set(_key_ids(disk_dir)) == {old_id} and len(times) == 5
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=new, prefix_cache_disk_old_key_files=[old]) as llm:
        disk = llm.engine.kv.prefix.tiers["disk"]
        disk.flush()
        assert disk.stats()["prefix_disk_rekeyed"] == 5 and set(_key_ids(disk_dir)) == {disk.cipher.key_id}
        new_id = disk.cipher.key_id
    assert sorted(os.stat(os.path.join(d, n)).st_mtime_ns for d, _, ns in os.walk(disk_dir) for n in ns
                  if n.endswith(".safetensors")) == times  # each kept its place in the LRU order
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=new) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.metrics["prefix_cached_tokens_disk"] == 64 and llm.stats()["prefix_disk_rekeyed"] == 0
        assert_close([want], [out], bitwise=True)
    assert old_id != new_id
    with disk_engine(ckpt, disk_dir, prefix_cache_disk_key_file=old) as llm:  # the retired key opens nothing
        assert llm.stats()["prefix_disk_discarded"] >= 5  # removed at start
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.num_cached_tokens == 0 and llm.stats()["prefix_disk_failures"] == 0
    with pytest.raises(ConfigError, match="prefix_cache_disk_unencrypted contradicts"):
        disk_engine(ckpt, disk_dir, prefix_cache_disk_old_key_files=[old], prefix_cache_disk_unencrypted=True)


def test_files_from_before_key_names_are_tried_under_every_key_and_resealed(ckpt, tmp_path, monkeypatch):
    """A file sealed before files named their key (no "key" in its metadata) under what is now the old
    key: the rotating engine tries its keys, opens it with the old one and re-seals it."""
    from sparsekv.cache.page_cipher import PageCipher
    old, new = _key(tmp_path, "a", b"a" * 40), _key(tmp_path, "b", b"b" * 40)
    seal = PageCipher.seal
    with monkeypatch.context() as m:
        m.setattr(PageCipher, "seal", lambda self, *a: (lambda t, meta: (t, {"nonce": meta["nonce"]}))(*seal(self, *a)))
        with disk_engine(ckpt, tmp_path / "disk", prefix_cache_disk_key_file=old) as llm:
            llm.generate([BASE + [3]], GREEDY)
    assert set(_key_ids(tmp_path / "disk")) == {None}
    with disk_engine(ckpt, tmp_path / "disk", prefix_cache_disk_key_file=new,
                     prefix_cache_disk_old_key_files=[old]) as llm:
        disk = llm.engine.kv.prefix.tiers["disk"]
        disk.flush()
        assert disk.stats()["prefix_disk_rekeyed"] == 5 and set(_key_ids(tmp_path / "disk")) == {disk.cipher.key_id}


def test_an_old_key_still_serves_hits_before_its_files_are_resealed(ckpt, tmp_path, monkeypatch):
    """With re-sealing held back, a file under the old key is read with it: the hit is served."""
    from sparsekv.cache.prefix_disk import PrefixDiskStore
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    old, new = _key(tmp_path, "a", b"a" * 40), _key(tmp_path, "b", b"b" * 40)
    with disk_engine(ckpt, tmp_path / "disk", prefix_cache_disk_key_file=old) as llm:
        llm.generate([BASE + [3]], GREEDY)
    monkeypatch.setattr(PrefixDiskStore, "_rekey", lambda self, name: None)
    with disk_engine(ckpt, tmp_path / "disk", prefix_cache_disk_key_file=new,
                     prefix_cache_disk_old_key_files=[old]) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.metrics["prefix_cached_tokens_disk"] == 64 and llm.stats()["prefix_disk_failures"] == 0
        assert_close([want], [out], bitwise=True)


# -- encryption by default, keyed tenant digests, files bound to their name and tenant -----------------
def _page_paths(root):
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".safetensors"))


def test_pages_are_encrypted_by_default_under_a_generated_key_a_restart_reuses(ckpt, tmp_path):
    """No key file named: the engine generates one in the tier's directory (0600) and seals every page
    with it, so no page bytes appear in the files; a restarted engine finds the same key and serves
    the prompt from disk bit for bit. Plaintext pages only with prefix_cache_disk_unencrypted."""
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    sealed_root, plain_root = tmp_path / "sealed", tmp_path / "plain"
    with disk_engine(ckpt, sealed_root) as llm:
        llm.generate([BASE + [3]], GREEDY)
        assert llm.engine.kv.prefix.tiers["disk"].cipher is not None
        page = llm.engine.kv.prefix.tiers["disk"].rows.copy_out(llm.engine.kv.allocator.cached.pages()[0])
    key = sealed_root / ".prefix-cache.key"
    secret = key.read_bytes()
    assert len(secret) == 32 and _mode(key) == 0o600
    plain_rows = page[0].contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:64]
    assert len(_page_paths(sealed_root)) == 5
    assert not any(plain_rows in open(f, "rb").read() for f in _page_paths(sealed_root))
    with disk_engine(ckpt, sealed_root) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.metrics["prefix_cached_tokens_disk"] == 64 and llm.stats()["prefix_disk_failures"] == 0
        assert_close([want], [out], bitwise=True)
    assert key.read_bytes() == secret
    with disk_engine(ckpt, plain_root, prefix_cache_disk_unencrypted=True) as llm:
        llm.generate([BASE + [3]], GREEDY)
        assert llm.engine.kv.prefix.tiers["disk"].cipher is None
    assert not (plain_root / ".prefix-cache.key").exists()
    assert any(plain_rows in open(f, "rb").read() for f in _page_paths(plain_root))  # the check above can see rows
    for bad in (dict(prefix_cache_disk_unencrypted=True, prefix_cache_disk_key_file=str(key)),
                dict(prefix_cache_disk_unencrypted=True, prefix_cache_disk_old_key_files=[str(key)])):
        with pytest.raises(ConfigError, match="prefix_cache_disk_unencrypted contradicts"):
            disk_engine(ckpt, tmp_path / "bad", **bad)
    with pytest.raises(ConfigError, match="prefix_cache_disk_unencrypted needs prefix_cache_disk_path"):
        make(ckpt, enable_prefix_caching=True, prefix_cache_disk_unencrypted=True)


def _store(rows, root, cipher=None, old=()):
    from sparsekv.cache.prefix_disk import PrefixDiskStore, page_file_bytes
    return PrefixDiskStore(rows, str(root), "space", 4 * page_file_bytes(rows, cipher), cipher, old_ciphers=list(old))


def test_a_landing_whose_disk_page_does_not_read_back_goes_to_the_host_tier(tmp_path):
    """Imported pages landing in the pool with the prompt's first pages held on disk: when one of those
    files is gone at the read, nothing lands (no pool page is kept or named) and the imported pages go
    to the host tier instead."""
    from sparsekv.cache.pages import PageAllocator
    from sparsekv.cache.prefix import PrefixCache
    from sparsekv.cache.prefix_host import PrefixHostStore
    rows = _rows(pages=8)
    disk = _store(rows, tmp_path)
    allocator = PageAllocator(8, PAGE)
    host = PrefixHostStore(rows, 8 * rows.page_bytes)
    cache = PrefixCache(allocator, tiers={"host": host, "disk": disk}, rows=rows, land_in_pool=True)
    prompt = list(range(1, 4 * PAGE + 2))
    names = cache.prompt_names(prompt, "default", None)
    disk.save_rows(names[0], rows.copy_out(0), "default")
    disk.flush()
    (first,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".safetensors")]
    disk.save_rows(names[1], rows.copy_out(1), "default")
    disk.flush()
    os.unlink(first)
    given = [(name, rows.copy_out(i)) for i, name in enumerate(names)][2:]
    assert cache.import_pages(given, "default", [names]) == 2
    assert host.num_pages == 2 and len(allocator.cached) == 0 and not cache._page_of
    allocator.check_integrity()
    disk.close()


def test_a_landing_given_up_on_a_disk_page_lets_go_of_the_held_pool_pages(tmp_path):
    """The prompt's first page in the pool, its second on disk and gone at the read, the rest imported:
    the landing is given up and the imported pages go to the host tier, and the pool page it held
    while reading is released again, with the pages it had reserved."""
    from sparsekv.cache.pages import PageAllocator
    from sparsekv.cache.prefix import PrefixCache
    from sparsekv.cache.prefix_host import PrefixHostStore
    rows = _rows(pages=8)
    disk = _store(rows, tmp_path)
    allocator = PageAllocator(8, PAGE)
    host = PrefixHostStore(rows, 8 * rows.page_bytes)
    cache = PrefixCache(allocator, tiers={"host": host, "disk": disk}, rows=rows, land_in_pool=True)
    names = cache.prompt_names(list(range(1, 4 * PAGE + 2)), "default", None)
    assert cache.import_pages([(names[0], rows.copy_out(0))], "default", []) == 1
    (first,) = cache._page_of.values()
    disk.save_rows(names[1], rows.copy_out(1), "default")
    disk.flush()
    os.unlink(disk.path_of(names[1]))
    given = [(name, rows.copy_out(i)) for i, name in enumerate(names)][2:]
    assert cache.import_pages(given, "default", [names]) == len(given)
    assert host.num_pages == len(given) and list(cache._page_of) == [names[0]]
    assert allocator.num_owners(first) == 0 and allocator.num_available == allocator.num_pages
    allocator.check_integrity()
    disk.close()


def test_an_export_stops_at_a_disk_page_that_does_not_read_back(tmp_path):
    """A prompt's pages exported from the disk tier (prefill/decode disaggregation): a page whose file is
    gone when it is read ends the export there, as a page not held does, with the pages before it; never
    a page without rows (the transfer failed on it, or sent pages past the gap)."""
    from sparsekv.cache.pages import PageAllocator
    from sparsekv.cache.prefix import PrefixCache
    rows = _rows(pages=8)
    disk = _store(rows, tmp_path)
    cache = PrefixCache(PageAllocator(8, PAGE), tiers={"disk": disk}, rows=rows)
    prompt = list(range(1, 3 * PAGE + 2))
    names = cache.prompt_names(prompt, "default", None)
    assert len(names) == 3
    files = {}
    for i, name in enumerate(names):
        before = set(_files(tmp_path))
        disk.save_rows(name, rows.copy_out(i), "default")
        disk.flush()
        (files[i],) = set(_files(tmp_path)) - before
    assert [n for n, _ in cache.export(prompt, "default", None)] == names
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == files[1]]
    os.unlink(path)
    exported = cache.export(prompt, "default", None)
    assert [n for n, _ in exported] == names[:1]
    assert all(torch.equal(a, b) for a, b in zip(exported[0][1], rows.copy_out(0)))
    disk.close()


def test_tenant_digests_are_keyed_with_a_secret_kept_with_the_tier(tmp_path):
    """A file's tenant field is an HMAC under the tier's own secret: not the SHA-256 of the name that
    anyone can compute, different in another tier, the same after a restart. In a sealed tier the
    secret is stored sealed, survives a key rotation, and is replaced when no key held opens it."""
    import hashlib
    import json

    from sparsekv.cache.page_cipher import PageCipher
    rows = _rows()
    first, other = _store(rows, tmp_path / "a"), _store(rows, tmp_path / "b")
    digest = first.tenant_digest("alice")
    assert digest != hashlib.sha256(b"sparsekv-tenant\0alice").hexdigest()[:32]
    assert digest != other.tenant_digest("alice") and digest != first.tenant_digest("bob")
    first.close()
    other.close()
    again = _store(rows, tmp_path / "a")
    assert again.tenant_digest("alice") == digest
    again.close()

    k1, k2, k3 = (PageCipher(bytes([i]) * 32, "space") for i in (1, 2, 3))
    record = tmp_path / "s" / "space" / ".tenant-key"
    sealed = _store(rows, tmp_path / "s", k1)
    digest = sealed.tenant_digest("alice")
    sealed.close()
    assert "secret" not in json.loads(record.read_text()) and json.loads(record.read_text())["key"] == k1.key_id
    rotated = _store(rows, tmp_path / "s", k2, old=[k1])
    assert rotated.tenant_digest("alice") == digest
    rotated.close()
    assert json.loads(record.read_text())["key"] == k2.key_id  # re-sealed with the new key
    rotated = _store(rows, tmp_path / "s", k2)
    assert rotated.tenant_digest("alice") == digest
    rotated.close()
    lost = _store(rows, tmp_path / "s", k3)
    assert lost.tenant_digest("alice") != digest
    lost.close()


def _rewrite_tenant(path, old_digest, new_digest):
    """Replace the tenant field in a page file's header (same length: the tensors stay in place)."""
    data = open(path, "rb").read()
    size = int.from_bytes(data[:8], "little")
    header = data[8:8 + size]
    assert header.count(old_digest.encode()) == 1
    open(path, "wb").write(data[:8] + header.replace(old_digest.encode(), new_digest.encode()) + data[8 + size:])


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_renamed_file_or_a_rewritten_tenant_field_is_never_served(tmp_path, sealed):
    """Page 0's file renamed to page 1's name, page 2's tenant field rewritten to another tenant's
    digest (after a restart, and while the engine runs): none is served, each counts as a failure and
    is removed; an untouched page still reads back."""
    from sparsekv.cache.page_cipher import PageCipher
    rows = _rows()
    cipher = PageCipher(b"k" * 32, "space") if sealed else None
    names = [bytes([i + 1]) * 32 for i in range(4)]
    disk = _store(rows, tmp_path, cipher)
    for i, name in enumerate(names):
        disk.save_rows(name, rows.copy_out(i), "alice")
    alice, mallory = disk.tenant_digest("alice"), disk.tenant_digest("mallory")
    disk.close()

    path = disk.path_of
    os.replace(path(names[0]), path(names[1]))
    _rewrite_tenant(path(names[2]), alice, mallory)
    disk = _store(rows, tmp_path, cipher)
    assert disk.has(names[1]) and disk.take(names[1]) is None
    assert disk.has(names[2]) and disk.take(names[2]) is None
    assert torch.equal(disk.take(names[3])[0], rows.copy_out(3)[0])
    _rewrite_tenant(path(names[3]), alice, mallory)  # while it runs: the digest it indexed stays the truth
    assert disk.take(names[3]) is None
    disk.flush()
    assert disk.failed == 3 and _files(tmp_path) == []
    disk.close()


# -- reads ahead of admission ---------------------------------------------------------------------------
def test_a_request_waits_for_its_disk_reads_while_others_keep_decoding(ckpt, tmp_path, monkeypatch):
    """The disk reads of a request's prefix run on a reader thread while it waits in the queue: the
    engine steps on (a running request keeps getting tokens), then it is admitted and hits every
    page from disk, with the same output. Aborting a waiting request discards its reads."""
    import threading

    from sparsekv.cache.prefix_disk import PrefixDiskStore
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    with disk_engine(ckpt, tmp_path) as llm:
        llm.generate([BASE + [3]], GREEDY)
    gate, read = threading.Event(), PrefixDiskStore._read
    monkeypatch.setattr(PrefixDiskStore, "_read", lambda self, name: gate.wait(30) and read(self, name))
    engine = disk_engine(ckpt, tmp_path).engine
    engine.add_request("running", OTHERS[0][:20], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.add_request("waiting", PROMPTS[0], GREEDY)
    tokens = 0
    for _ in range(5):
        tokens += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "running")
        engine.check_integrity()
    assert tokens == 5 and [r.request_id for r in engine.scheduler.waiting] == ["waiting"]
    gate.set()
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["waiting"].metrics["prefix_cached_tokens_disk"] == 64
    assert_close([want], [outs["waiting"]], bitwise=True)
    engine.close()
    gate.clear()  # reads block again: a request aborted while it waits for them leaves nothing behind
    engine = disk_engine(ckpt, tmp_path).engine
    engine.add_request("aborted", PROMPTS[0], GREEDY)
    assert engine.step() == [] and engine.kv.prefix._reading["aborted"]
    engine.abort("aborted")
    gate.set()
    engine.check_integrity()
    assert not engine.kv.prefix._reading and not engine.kv.prefix.tiers["disk"]._prefetched
    engine.close()


# -- tenants in the lower tiers: fair eviction, quotas, per-tenant figures -----------------------------
def _rows(pages=4, page=PAGE):
    from sparsekv.cache.prefix_host import PageRows
    pool = torch.arange(pages * page * 2, dtype=torch.float32).view(pages * page, 2)
    return PageRows([(pool, 1)], page)


def test_the_host_tier_evicts_the_largest_tenants_oldest_copy_and_holds_quotas():
    """Over budget, the tenant holding the most copies, the one being saved counted, loses its oldest
    (one tenant's traffic cannot flush another's); with a quota a tenant's copies beyond it spill at once, whatever room is left."""
    from sparsekv.cache.prefix_host import PrefixHostStore
    rows, spilled = _rows(), []
    host = PrefixHostStore(rows, 4 * rows.page_bytes, spill=lambda name, r, tenant: spilled.append((name, tenant)))
    host.save(b"q0", 0, "quiet")
    host.save(b"q1", 1, "quiet")
    for i in range(4):
        host.save(b"n%d" % i, i % 4, "noisy")
    assert spilled == [(b"n0", "noisy"), (b"n1", "noisy")]  # not quiet's older copies
    assert host.pages_by_tenant() == {"quiet": 2, "noisy": 2}
    host.save(b"q2", 2, "quiet")                              # quiet's third: 3 against 2, its own oldest
    assert spilled[-1] == (b"q0", "quiet") and host.pages_by_tenant() == {"quiet": 2, "noisy": 2}
    host.check_integrity()

    quota = PrefixHostStore(rows, 4 * rows.page_bytes, spill=lambda name, r, tenant: spilled.append((name, tenant)),
                            max_pages_per_tenant=1)
    spilled.clear()
    for name in (b"a", b"b", b"c"):
        quota.save(name, 0, "noisy")
    quota.save(b"q", 1, "quiet")
    assert spilled == [(b"a", "noisy"), (b"b", "noisy")] and quota.pages_by_tenant() == {"noisy": 1, "quiet": 1}
    assert [name for name, _, _ in quota.items()] == [b"c", b"q"]  # least recently used first
    quota.check_integrity()
    none = PrefixHostStore(rows, 4 * rows.page_bytes, spill=lambda name, r, tenant: spilled.append((name, tenant)),
                           max_pages_per_tenant=0)
    none.save(b"z", 0, "quiet")
    assert spilled[-1] == (b"z", "quiet") and none.num_pages == 0


def test_the_disk_tier_evicts_fairly_holds_quotas_and_applies_them_after_a_restart(tmp_path):
    from sparsekv.cache.prefix_disk import PrefixDiskStore, page_file_bytes
    rows = _rows()
    copy = [rows.copy_out(0)]
    budget = 4 * page_file_bytes(rows, None)
    disk = PrefixDiskStore(rows, str(tmp_path), "space", budget)
    for name, tenant in ((b"q0", "quiet"), (b"q1", "quiet"), *((b"n%d" % i, "noisy") for i in range(4))):
        disk.save_rows(name.ljust(32, b"\0"), copy[0], tenant)
    digests = {disk.tenant_digest(t): t for t in ("quiet", "noisy")}
    assert {digests[d]: n for d, n in disk.pages_by_tenant().items()} == {"quiet": 2, "noisy": 2}
    assert disk.has(b"q0".ljust(32, b"\0")) and not disk.has(b"n0".ljust(32, b"\0"))
    disk.check_integrity()
    disk.close()
    assert len(_files(tmp_path)) == 4

    restarted = PrefixDiskStore(rows, str(tmp_path), "space", budget, max_pages_per_tenant=1)
    assert {digests[d]: n for d, n in restarted.pages_by_tenant().items()} == {"quiet": 1, "noisy": 1}
    assert restarted.has(b"q1".ljust(32, b"\0")) and restarted.has(b"n3".ljust(32, b"\0"))  # each tenant's newest
    restarted.save_rows(b"n4".ljust(32, b"\0"), copy[0], "noisy")
    assert not restarted.has(b"n3".ljust(32, b"\0")) and restarted.has(b"q1".ljust(32, b"\0"))
    restarted.flush()
    restarted.check_integrity()
    assert len(_files(tmp_path)) == 2
    assert restarted.drop_page(b"q1".ljust(32, b"\0")) and not restarted.drop_page(b"q1".ljust(32, b"\0"))
    restarted.flush()
    restarted.check_integrity()
    assert len(_files(tmp_path)) == 1 and not restarted.has(b"q1".ljust(32, b"\0"))
    restarted.close()


def test_a_tenant_share_bounds_every_tier_and_keeps_the_quiet_tenants_prefix(ckpt, tmp_path):
    """`prefix_cache_tenant_share=0.5`: a noisy tenant's flood fills at most half of the pool's cache,
    the host tier and the disk tier, so a quiet tenant's prompt is still served whole from the cache,
    with the same tokens; per-tenant figures cover each tier."""
    page_bytes = _page_bytes(ckpt)
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_tenant_share=0.5, prefix_cache_host_bytes=4 * page_bytes,
               prefix_cache_disk_path=str(tmp_path), prefix_cache_disk_bytes=8 * _file_bytes(ckpt), **SMALL_POOL)
    engine = llm.engine
    engine.add_request("quiet", BASE + [3], GREEDY, tenant="quiet")
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(8):  # the flood: 8 prompts of 4 full pages each
        prompt = [(11 * i + 3 * j) % 250 + 1 for j in range(70)]
        engine.add_request(f"noisy-{i}", prompt, GREEDY, tenant="noisy")
        while engine.has_unfinished_requests():
            engine.step()
    by_tenant = llm.stats()["prefix_cache_by_tenant"]
    noisy = by_tenant["noisy"]
    assert noisy["cached_pages"] <= 6 and noisy["host_pages"] <= 2 and noisy["disk_pages"] <= 4  # half of 12, 4, 8
    assert noisy["host_pages"] == 2 and noisy["disk_pages"] == 4   # full shares: the flood reached every tier
    quiet = by_tenant["quiet"]
    assert quiet["cached_pages"] + quiet["host_pages"] + quiet["disk_pages"] == 5
    engine.add_request("again", PROMPTS[0], GREEDY, tenant="quiet")
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.num_cached_tokens == 64 and out.token_ids == want.token_ids
    engine.check_integrity()
    llm.close()
    for share in (0, 1.5):
        with pytest.raises(ConfigError, match="prefix_cache_tenant_share"):
            make(ckpt, enable_prefix_caching=True, prefix_cache_tenant_share=share)


def test_without_read_ahead_the_admitting_step_reads_the_disk_pages(ckpt, tmp_path):
    """prefix_cache_disk_read_ahead=False: the request is admitted in its first step and its disk pages
    are read there (no step of waiting); the hit is the same and so is the output."""
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    with disk_engine(ckpt, tmp_path) as llm:
        llm.generate([BASE + [3]], GREEDY)
    with disk_engine(ckpt, tmp_path, prefix_cache_disk_read_ahead=False) as llm:
        engine = llm.engine
        engine.add_request("sync", PROMPTS[0], GREEDY)
        engine.step()
        assert [r.request_id for r in engine.scheduler.running] == ["sync"] and not engine.kv.prefix._reading
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["sync"].metrics["prefix_cached_tokens_disk"] == 64
    assert_close([want], [outs["sync"]], bitwise=True)


# -- file names, MACs, retention at close, the whole directory's budget, hostile entries ----------------
def _flip_last_data_byte(path):
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x40  # inside the last tensor's bytes
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("options", [{}, dict(prefix_cache_disk_unencrypted=True)], ids=["sealed", "plain"])
def test_file_names_do_not_reveal_the_pages_a_guessed_prompt_would_name(ckpt, tmp_path, options):
    """Anyone can compute a (tenant, prompt)'s page names (sha256 chains from the tenant); the files are
    named by an HMAC of them under the tier's secret, so a listing matches none of a guessed chain,
    while the engine still finds every page after a restart."""
    with disk_engine(ckpt, tmp_path, **options) as llm:
        llm.engine.add_request("a", BASE + [3], GREEDY, tenant="alice")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        guessed = llm.engine.kv.prompt_chains([PROMPTS[0]], tenant="alice")[0]
        disk = llm.engine.kv.prefix.tiers["disk"]
    stems = {os.path.basename(p)[:-len(".safetensors")] for p in _page_paths(tmp_path)}
    assert len(stems) == 5 and len(guessed) == 4
    assert not stems & {name.hex() for name in guessed}
    assert all(os.path.exists(disk.path_of(name)) for name in guessed)
    with disk_engine(ckpt, tmp_path, **options) as llm:
        llm.engine.add_request("again", PROMPTS[0], GREEDY, tenant="alice")
        out = None
        while llm.engine.has_unfinished_requests():
            out = next((o for o in llm.engine.step() if o.finished), out)
        assert out.metrics["prefix_cached_tokens_disk"] == 64


def test_a_changed_byte_of_a_plain_files_rows_is_a_counted_miss(ckpt, tmp_path):
    """Unencrypted files carry an HMAC of their rows too: a flipped data byte in every file reads as a
    miss (counted, the file removed), and the output equals a run without the cache."""
    want = make(ckpt, **SMALL_POOL).generate([PROMPTS[0]], GREEDY)[0]
    with disk_engine(ckpt, tmp_path, prefix_cache_disk_unencrypted=True) as llm:
        llm.generate([BASE + [3]], GREEDY)
    for path in _page_paths(tmp_path):
        _flip_last_data_byte(path)
    with disk_engine(ckpt, tmp_path, prefix_cache_disk_unencrypted=True) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.num_cached_tokens == 0 and llm.stats()["prefix_disk_failures"] == 4  # each page read ahead
        assert_close([want], [out], bitwise=True)


def _rewrite_tensors(path, change):
    """Rewrite a page file with its tensors changed by `change` (a dict -> dict), its metadata kept."""
    from safetensors.torch import load, save

    from sparsekv.cache.prefix_disk import _page_metadata
    data = open(path, "rb").read()
    open(path, "wb").write(save(change(dict(load(data))), metadata=_page_metadata(data)))


TENSOR_CHANGES = {"added": lambda tensors: dict(tensors, extra=torch.zeros(1 << 10)),
                  "removed": lambda tensors: dict(list(tensors.items())[1:])}


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("change", sorted(TENSOR_CHANGES))
def test_a_page_file_with_a_tensor_added_or_removed_is_a_counted_miss(tmp_path, caplog, sealed, change):
    """A page file holds exactly a page's tensors (its rows, or its sealed bytes): one rewritten with
    an extra tensor beside its untouched, authenticated ones (a file grown by someone else, larger than
    the budget counts it), or with one of its own gone, is a miss, logged, counted and removed, not served."""
    from sparsekv.cache.page_cipher import PageCipher
    rows = _rows()
    disk = _store(rows, tmp_path, PageCipher(b"k" * 32, "space") if sealed else None)
    name = b"\1" * 32
    disk.save_rows(name, rows.copy_out(0), "alice")
    disk.flush()
    _rewrite_tensors(disk.path_of(name), TENSOR_CHANGES[change])
    assert disk.take(name) is None
    disk.flush()
    assert disk.failed == 1 and not disk.has(name) and _files(tmp_path) == []
    assert "is unreadable" in caplog.text
    disk.close()


def test_an_unencrypted_tier_warns_and_says_so(ckpt, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="sparsekv.cache.manager"):
        llm = disk_engine(ckpt, tmp_path, prefix_cache_disk_unencrypted=True)
    assert any("unencrypted" in r.getMessage() for r in caplog.records)
    assert llm.stats()["prefix_disk_encrypted"] == 0
    assert llm.engine.cache_config()["prefix_cache_disk_encrypted"] == "False"
    llm.close()
    with disk_engine(ckpt, tmp_path / "sealed") as llm:
        assert llm.stats()["prefix_disk_encrypted"] == 1
        assert llm.engine.cache_config()["prefix_cache_disk_encrypted"] == "True"


def test_closing_persists_no_expired_page_and_stamps_files_with_their_last_use(ckpt, tmp_path):
    """With a 60 s TTL on a clock 100 s behind: pages last used 70 s before the engine closes are not
    saved; pages used 40 s before it are saved with their time of last use, so a restart (the real
    clock, 100 s later) expires them instead of serving them."""
    import time
    now = [time.time() - 100]
    llm = disk_engine(ckpt, tmp_path, prefix_cache_ttl_s=60)
    llm.engine.kv.prefix.set_clock(lambda: now[0])
    llm.generate([BASE + [3]], GREEDY)
    now[0] += 70
    llm.close()
    assert _files(tmp_path) == []

    now[0] = time.time() - 100
    llm = disk_engine(ckpt, tmp_path, prefix_cache_ttl_s=60)
    llm.engine.kv.prefix.set_clock(lambda: now[0])
    used = now[0]
    llm.generate([BASE + [3]], GREEDY)
    now[0] += 40
    llm.close()
    assert len(_files(tmp_path)) == 5
    assert all(os.stat(p).st_mtime <= used + 1 for p in _page_paths(tmp_path))
    with disk_engine(ckpt, tmp_path, prefix_cache_ttl_s=60) as later:
        assert later.generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 0
        assert later.stats()["prefix_cache_expired_pages"] == 5


def _sizes(root):
    return sum(os.path.getsize(p) for p in _page_paths(root))


def test_the_budget_covers_every_namespace_of_the_directory(ckpt, tmp_path):
    """An engine with another page size (another namespace) on a directory an earlier one filled:
    the earlier namespace's files count against the budget and go first, its emptied directory is
    removed, and the page files of the whole directory stay within the budget, counted whole."""
    with disk_engine(ckpt, tmp_path, host_pages=0) as llm:
        for prompt in [BASE + [3], *OTHERS]:
            llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    first = [e.path for e in os.scandir(tmp_path) if e.is_dir()]
    assert len(first) == 1 and len(_page_paths(tmp_path)) > 6
    options = dict(kv_page_size=2 * PAGE, prefill_chunk_tokens=2 * PAGE)
    budget = 3 * _file_bytes_of(ckpt, **options)
    with make(ckpt, enable_prefix_caching=True, prefix_cache_disk_path=str(tmp_path), prefix_cache_disk_bytes=budget,
              **dict(SMALL_POOL, **options)) as llm:
        llm.engine.kv.prefix.tiers["disk"].flush()  # the removals, queued at start
        assert _sizes(tmp_path) <= budget
        for prompt in [BASE + [3], *OTHERS]:
            llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
            llm.engine.kv.prefix.tiers["disk"].flush()
            assert _sizes(tmp_path) <= budget
        disk = llm.engine.kv.prefix.tiers["disk"]
        assert disk.bytes_used == sum(os.path.getsize(p) for p in _page_paths(disk.dir)) > 0
    assert _sizes(tmp_path) <= budget
    assert not os.path.exists(first[0])
    assert len([e for e in os.scandir(tmp_path) if e.is_dir()]) == 1


def _file_bytes_of(ckpt, **options):
    from sparsekv.cache.page_cipher import PageCipher
    from sparsekv.cache.prefix_disk import page_file_bytes
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, **dict(SMALL_POOL, **options))
    return page_file_bytes(llm.engine.kv.prefix.tiers["host"].rows, PageCipher(b"k" * 32, "space"))


def _in_thread(fn, timeout=20):
    """fn() on a daemon thread: (finished within `timeout`, its result)."""
    import threading
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), result[0] if result else None


def test_a_fifo_or_directory_named_like_a_page_never_hangs_the_tier(tmp_path):
    """A FIFO and a directory named like page files are ignored at start (a blocking open would hang
    it); a page file replaced by a FIFO while the engine runs reads as a miss, without blocking."""
    rows = _rows()
    space = tmp_path / "space"
    space.mkdir(mode=0o700)
    os.mkfifo(space / ("ab" * 32 + ".safetensors"))
    (space / ("cd" * 32 + ".safetensors")).mkdir()
    done, disk = _in_thread(lambda: _store(rows, tmp_path))
    assert done and disk.num_pages == 0
    name = b"\1" * 32
    disk.save_rows(name, rows.copy_out(0), "alice")
    disk.flush()
    os.unlink(disk.path_of(name))
    os.mkfifo(disk.path_of(name))
    done, got = _in_thread(lambda: disk.take(name))
    assert done and got is None and disk.failed == 1
    disk.close()


def test_temporary_files_never_follow_a_planted_symlink(tmp_path, monkeypatch):
    """Every file is written under a temporary name created O_EXCL|O_NOFOLLOW: a symlink planted at
    that name makes the write fail (the tenant key at start, a page later: counted), and its target
    is never written."""
    import sparsekv.cache.prefix_disk_files as prefix_disk_files
    rows = _rows()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "tier" / "space").mkdir(parents=True, mode=0o700)
    planted = str(tmp_path / "tier" / "space" / ".planted.tmp")
    os.symlink(victim, planted)
    with monkeypatch.context() as m:
        m.setattr(prefix_disk_files, "temporary_path", lambda directory: planted)
        with pytest.raises(OSError):
            _store(rows, tmp_path / "tier")
    assert victim.read_text() == "precious"
    disk = _store(rows, tmp_path / "tier")  # a fresh name each time: the tier starts (and sweeps the .tmp)
    os.symlink(victim, planted)
    monkeypatch.setattr(prefix_disk_files, "temporary_path", lambda directory: planted)
    disk.save_rows(b"\1" * 32, rows.copy_out(0), "alice")
    disk.flush()
    assert disk.failed == 1 and not disk.has(b"\1" * 32) and victim.read_text() == "precious"
    disk.close()


def test_a_key_file_others_may_read_is_refused_and_a_shared_directory_warned_about(ckpt, tmp_path, caplog):
    key = _key(tmp_path)
    os.chmod(key, 0o640)
    with pytest.raises(ConfigError, match=f"prefix_cache_disk_key_file: {key} may be read.*chmod 600"):
        disk_engine(ckpt, tmp_path / "a", prefix_cache_disk_key_file=key)
    disk_engine(ckpt, tmp_path / "b").close()
    os.chmod(tmp_path / "b" / ".prefix-cache.key", 0o644)  # the generated one, loosened
    with pytest.raises(ConfigError, match="chmod 600"):
        disk_engine(ckpt, tmp_path / "b")
    os.chmod(key, 0o600)
    old = _key(tmp_path, "old", b"o" * 40)
    os.chmod(old, 0o604)
    with pytest.raises(ConfigError, match="prefix_cache_disk_old_key_files: .* may be read"):
        disk_engine(ckpt, tmp_path / "a", prefix_cache_disk_key_file=key, prefix_cache_disk_old_key_files=[old])
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with caplog.at_level("WARNING", logger="sparsekv.cache.prefix_disk"):
        disk_engine(ckpt, shared, prefix_cache_disk_key_file=key).close()
    assert any("may be written by group or others" in r.getMessage() for r in caplog.records)


def test_a_full_disk_evicts_the_oldest_pages_and_retries_the_write_once(tmp_path, monkeypatch):
    """ENOSPC below the budget: the oldest file is removed and the write tried again, which succeeds;
    a disk that stays full counts the write as failed."""
    import errno

    import sparsekv.cache.prefix_disk as prefix_disk
    rows, write = _rows(), prefix_disk.write_private_file
    disk = _store(rows, tmp_path)
    names = [bytes([i + 1]) * 32 for i in range(4)]
    for name in names[:2]:
        disk.save_rows(name, rows.copy_out(0), "alice")
    disk.flush()
    full = [1]

    def full_once(*args, **kwargs):
        if full[0]:
            full[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(*args, **kwargs)
    monkeypatch.setattr(prefix_disk, "write_private_file", full_once)
    disk.save_rows(names[2], rows.copy_out(1), "alice")
    disk.flush()
    assert disk.failed == 0 and disk.has(names[2]) and not disk.has(names[0]) and disk.has(names[1])
    assert torch.equal(disk.take(names[2])[0], rows.copy_out(1)[0]) and len(_files(tmp_path)) == 2
    full[0] = 2
    disk.save_rows(names[3], rows.copy_out(2), "alice")
    disk.flush()
    assert disk.failed == 1 and not disk.has(names[3]) and len(_files(tmp_path)) == len(disk._files)
    disk.check_integrity()
    disk.close()


def files_that(open_file, during_read):
    """A stand-in for `prefix_disk.open_regular` whose files hand each read's bytes to `during_read`
    (which may change the tier meanwhile) and return what it returns."""
    class File:
        def __init__(self, path):
            self.f = open_file(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, *args):
            return during_read(self.f.read(*args))
    return File


@pytest.mark.parametrize("damaged", [False, True], ids=["whole", "damaged"])
def test_a_page_leaving_the_tier_while_it_is_read_is_neither_served_nor_a_failure(ckpt, tmp_path, monkeypatch,
                                                                                   caplog, damaged):
    """A read of a page file that the tier drops meanwhile (a reset, an eviction, its TTL): the page is
    not served, and it is no unreadable file (no failure counted, no warning), whether its bytes were
    read whole or not (its file removed or replaced under the read)."""
    from sparsekv.cache import prefix_disk
    llm = disk_engine(ckpt, tmp_path, host_pages=0)
    _evict_then_hit(llm, PROMPTS[:3])
    disk = llm.engine.kv.prefix.tiers["disk"]
    disk.flush()
    file_id = disk._files.keys(None)[0]
    real = prefix_disk.open_regular

    def leaves_while_read(data: bytes) -> bytes:
        disk.drop()  # the page leaves the tier while its bytes are in flight
        return data[:len(data) // 2] if damaged else data
    monkeypatch.setattr(prefix_disk, "open_regular", files_that(real, leaves_while_read))
    assert disk._read(file_id) is None
    assert disk.failed == 0 and "unreadable" not in caplog.text
    monkeypatch.setattr(prefix_disk, "open_regular", real)
    disk.flush()
    llm.engine.check_integrity()


def test_host_and_disk_hits_are_counted_to_the_tenant_they_served(ckpt, tmp_path):
    """Two tenants, one served from the host tier and the other from the disk tier: every figure of
    `prefix_cache_by_tenant` exact. The pool keeps no page (quota 0: released pages go straight to a
    host tier of 4 pages). bob's X fills the host tier, his Y pushes X out to disk, alice's Z pushes
    two of Y's pages out (bob holds the most), so her Z again hits the host tier only and his X the
    disk tier only."""
    x = [(5 * i) % 250 + 1 for i in range(4 * PAGE + 3)]          # 4 cacheable pages
    y = [(3 * i + 7) % 250 + 1 for i in range(4 * PAGE + 3)]      # 4 other pages
    z = [(11 * i + 2) % 250 + 1 for i in range(2 * PAGE + 3)]     # 2 pages
    engine = disk_engine(ckpt, tmp_path, host_pages=4, prefix_cache_max_pages_per_tenant=0).engine

    def run(rid, prompt, tenant):
        engine.add_request(rid, prompt, GREEDY, tenant=tenant)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        return done[0]
    for rid, prompt, tenant in (("x", x, "bob"), ("y", y, "bob"), ("z", z, "alice")):
        assert run(rid, prompt, tenant).num_cached_tokens == 0
    stats = engine.stats()
    assert stats["prefix_host_pages"] == 4 and stats["prefix_disk_pages"] == 6  # X's 4 and Y's oldest 2
    assert stats["prefix_cache_by_tenant"]["bob"]["host_pages"] == 2
    assert stats["prefix_cache_by_tenant"]["alice"]["host_pages"] == 2
    z_again = run("z2", z, "alice")
    assert (z_again.metrics["prefix_cached_tokens_host"], z_again.metrics["prefix_cached_tokens_disk"]) == (2 * PAGE, 0)
    x_again = run("x2", x, "bob")
    assert (x_again.metrics["prefix_cached_tokens_host"], x_again.metrics["prefix_cached_tokens_disk"]) == (0, 4 * PAGE)
    stats = engine.stats()
    assert (stats["prefix_cache_hits_device"], stats["prefix_cache_hits_host"], stats["prefix_cache_hits_disk"]) == \
        (0, 2 * PAGE, 4 * PAGE)
    by_tenant = stats["prefix_cache_by_tenant"]
    assert {t: (c["queries"], c["hits"]) for t, c in by_tenant.items()} == \
        {"bob": (3 * len(x), 4 * PAGE), "alice": (2 * len(z), 2 * PAGE)}
    # X's restored pages were named again as bob's: released, they pushed Y's last two pages out of
    # the host tier (bob holds the most), then X3 and X2 (already on disk); Z stayed
    assert by_tenant == {"alice": {"queries": 2 * len(z), "hits": 2 * PAGE, "cached_pages": 0, "host_pages": 2,
                                   "disk_pages": 0},
                         "bob": {"queries": 3 * len(x), "hits": 4 * PAGE, "cached_pages": 0, "host_pages": 2,
                                 "disk_pages": 8}}
    engine.check_integrity()
    engine.close()


def test_a_disk_tier_of_exactly_one_page_file_is_enough_and_a_byte_less_is_refused(ckpt, tmp_path):
    """prefix_cache_disk_bytes counts whole page files, metadata included: a budget of exactly one file
    makes a one-file tier, a byte less is a ConfigError naming the option and the file size."""
    one = _file_bytes(ckpt, sealed=False)
    options = dict(enable_prefix_caching=True, prefix_cache_disk_unencrypted=True, **SMALL_POOL)
    with make(ckpt, prefix_cache_disk_path=str(tmp_path / "one"), prefix_cache_disk_bytes=one, **options) as llm:
        assert "disk" in llm.engine.kv.prefix.tiers
    with pytest.raises(ConfigError, match=f"prefix_cache_disk_bytes={one - 1} holds less than one page file .*{one} B"):
        make(ckpt, prefix_cache_disk_path=str(tmp_path / "less"), prefix_cache_disk_bytes=one - 1, **options)
