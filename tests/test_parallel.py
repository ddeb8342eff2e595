"""Tensor and expert parallelism on two local processes (torch.distributed, gloo): the same greedy tokens
as the single-process engine, with logprobs within the bound of a regrouped reduction.

Tensor parallelism computes the same terms as one process and adds them in other groups: o_proj's sum
over the heads and each MLP's down projection over its intermediate dimension become two partial sums
that the all-reduce adds. That is a regrouped reduction, bounded by tests/tolerances.py. The
embedding (one non-zero term per element) and the lm_head's all-gather are exact, and every rank
selects the same positions (the indexer is replicated and reads all-reduced hidden states).
"""
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsekv import LLM, SamplingParams
from sparsekv.config import ConfigError
from sparsekv.paths import default_model_path
from conftest import STARTUP_FLAGS, STARTUP_S
from tolerances import assert_same_greedy, logprob_tolerance

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
BASE = dict(kv_page_size=4, max_model_len=128, num_threads=1, dist_startup_timeout_s=STARTUP_S)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    # 40 tokens: past the tiny models' index_topk (8), so the indexer's top-k decides what is attended
    return [torch.randint(1, vocab, (40,), generator=g).tolist(), torch.randint(1, vocab, (13,), generator=g).tolist()]


def _compare(path: str, vocab: int, **options) -> None:
    prompts = _prompts(vocab)
    single = LLM(path, **BASE, **{k: v for k, v in options.items() if k not in ("tensor_parallel_size",
                                                                               "enable_expert_parallel",
                                                                               "decode_graphs")})
    want = single.generate(prompts, PARAMS)
    llm = LLM(path, **BASE, **options)
    try:
        got = llm.generate(prompts, PARAMS)
        llm.engine.check_integrity()
        tol = logprob_tolerance(single, extra_layers=1 if options.get("num_speculative_tokens") else 0)
        assert_same_greedy(want, got, tol)
        shard, whole = llm.engine.model.weight_bytes, single.engine.model.weight_bytes
        assert shard < whole, "rank 0 holds the whole model"
        if options.get("decode_graphs") == "eager":  # against the one-process engine's own decode path
            stats = llm.engine.stats()
            assert stats["decode_graph_steps"] > 0
            if options.get("num_speculative_tokens", 0) > 1:
                assert stats["decode_graph_draft_steps"] > 0
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm.engine.executor.ranks.processes), "close() left a worker running"


def _with_mtp_layer(src: str, dst: str, own_embed_and_head: bool) -> str:
    """A copy of a tiny checkpoint with a NextN layer (a copy of layer 1 with layer 0's indexer), and
    optionally DeepSeek's layer-local embedding and head (vocab-parallel under tensor parallelism)."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    hidden, layers = tensors["model.norm.weight"].shape[0], 1 + max(int(n.split(".")[2]) for n in tensors
                                                                  if n.startswith("model.layers."))
    g = torch.Generator().manual_seed(3)
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1.") and ".indexer." not in name:
            tensors[name.replace("layers.1.", f"layers.{layers}.")] = t.clone()
        if name.startswith("model.layers.0.self_attn.indexer."):
            tensors[name.replace("layers.0.", f"layers.{layers}.")] = t.clone()
    p = f"model.layers.{layers}."
    tensors.update({p + "enorm.weight": torch.ones(hidden), p + "hnorm.weight": torch.ones(hidden),
                    p + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
                    p + "shared_head.norm.weight": torch.ones(hidden)})
    if own_embed_and_head:
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].flip(0).clone()
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].flip(0).clone()
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16),
                                     dict(enable_expert_parallel=True),
                                     dict(selector="quest", quest_page_tokens=2, kv_tiering=True, device_buffer_tokens=16),
                                     dict(enable_expert_parallel=True, decode_graphs="eager"),
                                     dict(kv_tiering=True, device_buffer_tokens=8, decode_graphs="eager"),
                                     dict(selector="quest", quest_page_tokens=2, decode_graphs="eager")],
                         ids=["tp2", "tp2-tiered", "tp2-ep", "tp2-quest-tiered", "tp2-ep-decode-graphs",
                              "tp2-tiered-decode-graphs", "tp2-quest-decode-graphs"])
def test_tensor_parallel_glm_equals_one_process(glm_ckpt, options):
    _compare(glm_ckpt[0], 256, tensor_parallel_size=2, **options)


@pytest.mark.parametrize("options", [{}, dict(enable_expert_parallel=True, kv_tiering=True, device_buffer_tokens=16),
                                     dict(decode_graphs="eager")],
                         ids=["tp2", "tp2-ep-tiered", "tp2-decode-graphs"])
def test_tensor_parallel_deepseek_equals_one_process(ds_ckpt, options):
    _compare(ds_ckpt[0], 256, tensor_parallel_size=2, **options)


@pytest.mark.parametrize("graphs", ["off", "eager", "tiered", "quest"],
                         ids=["", "decode-graphs", "tiered-decode-graphs", "quest-decode-graphs"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_tensor_parallel_with_mtp_drafting_equals_one_process(family, graphs, glm_ckpt, ds_ckpt, tmp_path):
    """With decode graphs, the verification steps and draft steps run as their pieces on both ranks;
    tiered too (working sets of 3 x top-k entries, what a decode and its 2 drafts may select), and with
    Quest (pages of 2 tokens: a rejected draft's page rewound on each rank)."""
    src = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    path = _with_mtp_layer(src, str(tmp_path / family), own_embed_and_head=family == "ds")
    extra = {"tiered": dict(kv_tiering=True, device_buffer_tokens=24),
             "quest": dict(selector="quest", quest_page_tokens=2)}.get(graphs, {})
    _compare(path, 256, tensor_parallel_size=2, num_speculative_tokens=2, enable_expert_parallel=family == "ds",
             decode_graphs="eager" if extra else graphs, **extra)


def test_tensor_parallel_bundled_model_tiered_mtp():
    _compare(default_model_path(), 4096, tensor_parallel_size=2, kv_tiering=True, num_speculative_tokens=2)


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
    (dict(tensor_parallel_size=2, nnodes=2), "needs dist_init_addr"),
    (dict(tensor_parallel_size=2, data_parallel_size=2), "runs with tensor_parallel_size 1"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1"), "only hosts ranks"),
    (dict(tensor_parallel_size=2, dist_init_addr="nohost"), "HOST:PORT"),
])
def test_bad_layouts_fail_before_any_process_starts(glm_ckpt, options, message):
    import multiprocessing
    before = len(multiprocessing.active_children())
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(glm_ckpt[0], **BASE, **options)
    assert len(multiprocessing.active_children()) == before


def test_experts_must_divide_across_the_world_with_expert_parallelism(glm_ckpt):
    from dataclasses import replace

    from sparsekv.config import ModelConfig
    from sparsekv.parallel.layout import ParallelLayout
    cfg = replace(ModelConfig.from_json(glm_ckpt[0]), n_routed_experts=6)
    ParallelLayout(2, 1, expert_parallel=True).check_model(cfg)
    ParallelLayout(4, 1, expert_parallel=False).check_model(replace(cfg, num_attention_heads=8, vocab_size=512))
    with pytest.raises(ConfigError, match=r"n_routed_experts \(6\) is not divisible by the world size"):
        ParallelLayout(4, 1, expert_parallel=True).check_model(replace(cfg, num_attention_heads=8, vocab_size=512))
    assert list(ParallelLayout(2, 1, True, rank=1).local_experts(6)) == [3, 4, 5]


def test_a_worker_failing_at_load_fails_start_up_with_its_message(glm_ckpt, tmp_path):
    """With expert parallelism rank 1 alone reads experts 2 and 3. Their shard file is corrupt: start-up
    fails with rank 1's error (rank 0 loaded fine), and every worker process ends."""
    import json
    import multiprocessing
    path = tmp_path / "ckpt"
    shutil.copytree(glm_ckpt[0], path)
    tensors = load_file(path / "model.safetensors")
    os.remove(path / "model.safetensors")
    theirs = {n for n in tensors if ".mlp.experts.2." in n or ".mlp.experts.3." in n}
    save_file({n: t for n, t in tensors.items() if n not in theirs}, path / "model-00001-of-00002.safetensors")
    (path / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {n: "model-00002-of-00002.safetensors" if n in theirs else "model-00001-of-00002.safetensors"
                  for n in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(RuntimeError, match="rank 1: .*model-00002-of-00002|rank 1: .*(header|deserializ)"):
        LLM(str(path), **BASE, tensor_parallel_size=2, enable_expert_parallel=True)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("sparsekv-rank")]


@pytest.mark.parametrize("layout", [["-tp", "2"], ["-dp", "2", "--enable-expert-parallel"]], ids=["tp2", "dp2-ep"])
def test_two_nodes_of_one_process_each_equal_one_process(glm_ckpt, layout):
    """--nnodes 2 on localhost: node 1 is `sparsekv serve --node-rank 1` in another process (it hosts
    rank 1 and serves nothing); node 0 is the engine."""
    import subprocess
    import sys

    from test_server_util import REPO, free_port
    path, port = glm_ckpt[0], free_port()
    dist = [*layout, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", *STARTUP_FLAGS]
    options = (dict(tensor_parallel_size=2) if layout[0] == "-tp" else
               dict(data_parallel_size=2, enable_expert_parallel=True))
    node1 = subprocess.Popen([sys.executable, "-m", "sparsekv", "serve", path, "--node-rank", "1", "--kv-page-size", "4",
                              "--max-model-len", "128", *dist], env={**os.environ, "PYTHONPATH": REPO},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        prompts = _prompts(256)
        single = LLM(path, **BASE)
        want = single.generate(prompts, PARAMS)
        llm = LLM(path, **BASE, **options, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
        try:
            assert not _rank_processes()  # rank 1 lives on the other "node"
            got = llm.generate(prompts, PARAMS)
        finally:
            llm.close()
        assert_same_greedy(want, got, logprob_tolerance(single))
        assert node1.wait(timeout=60) == 0, node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def _node1(path: str, port: int, *extra: str, layout: tuple = ("-tp", "2")):
    """Node 1 of a -tp 2 (or `layout`) world over two "nodes" on localhost, in a session of its own (killpg
    reaches its rank)."""
    import subprocess
    import sys

    from test_server_util import REPO
    return subprocess.Popen([sys.executable, "-m", "sparsekv", "serve", path, "--node-rank", "1", "--kv-page-size", "4",
                             "--max-model-len", "128", *layout, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}",
                             *STARTUP_FLAGS, *extra], env={**os.environ, "PYTHONPATH": REPO}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("layout", [("-tp", "2"), ("-dp", "2")], ids=["tp2", "dp2"])
def test_an_idle_engine_finds_a_dead_node_without_a_request(glm_ckpt, layout):
    """Node 1's ranks have no process on node 0 to look at: an idle engine's check_ranks (what the idle
    server calls) asks every rank every RANK_PROBE_S, so node 1 killed while nothing runs is a
    RankFailure there (the server's /health then turns 503); it stayed healthy until a request came.
    Tensor- and data-parallel engines alike."""
    import signal

    from sparsekv.engine import RANK_PROBE_S
    from sparsekv.parallel.launch import RankFailure
    from test_server_util import free_port, wait_until
    port = free_port()
    node1 = _node1(glm_ckpt[0], port, layout=layout)
    llm = None
    size = dict(tensor_parallel_size=2) if layout[0] == "-tp" else dict(data_parallel_size=2)
    try:
        llm = LLM(glm_ckpt[0], **BASE, **size, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
        llm.engine.check_ranks()  # everyone there
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait(timeout=30)

        def found() -> bool:
            try:
                llm.engine.check_ranks()
            except RankFailure:
                return True
            return False
        assert wait_until(found, timeout=RANK_PROBE_S + 30, interval=0.1)
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
        if llm is not None:
            llm.close()


@contextlib.contextmanager
def _two_nodes(path: str):
    """Node 0's tensor-parallel engine here and node 1 as `sparsekv serve --node-rank 1`: (node 1's
    process, the pid of the rank it started)."""
    import signal
    import subprocess

    from test_server_util import free_port
    port = free_port()
    node1 = _node1(path, port)
    llm = None
    try:
        llm = LLM(path, **BASE, tensor_parallel_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
        children = subprocess.run(["pgrep", "-P", str(node1.pid)], capture_output=True, text=True).stdout.split()
        ranks = [pid for pid in children if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(ranks) == 1, children
        yield node1, int(ranks[0])
    finally:
        try:
            os.killpg(node1.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node1.wait()
        if llm is not None:
            llm.close()


def test_sigterm_to_a_node_stops_its_ranks(glm_ckpt):
    """SIGTERM to node 1's command (its launcher, as a supervisor sends it) stops the rank it started (the
    rank was orphaned and went on serving node 0's engine); the command exits 143."""
    import signal

    from test_server_util import wait_until
    with _two_nodes(glm_ckpt[0]) as (node1, rank):
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(timeout=30) == 128 + signal.SIGTERM
        assert wait_until(lambda: not os.path.exists(f"/proc/{rank}") or
                          open(f"/proc/{rank}/stat").read().split()[2] == "Z", timeout=30)


def test_a_node_whose_rank_a_signal_killed_exits_as_a_shell_reports_it(glm_ckpt):
    """Node 1's rank killed by SIGKILL (the kernel's OOM killer sends it): node 1's command exits 128 + 9,
    as a shell reports a killed command (it exited with the rank's exit code -9, which sys.exit turned
    into 247)."""
    import signal
    with _two_nodes(glm_ckpt[0]) as (node1, rank):
        os.kill(rank, signal.SIGKILL)
        assert node1.wait(timeout=30) == 128 + signal.SIGKILL


def test_a_node_started_with_other_options_fails_the_start_naming_them(glm_ckpt, tmp_path):
    """Each node parses its own flags: node 1 with expert parallelism, or another checkpoint of the same
    shapes, computed other tokens without a word. The start fails on both nodes, naming the difference,
    and node 1's command exits 1."""
    import shutil
    import subprocess
    import sys

    from sparsekv.parallel.launch import StartupError
    from sparsekv.tools.tiny import save_reference_checkpoint
    from test_server_util import REPO, free_port
    copy, reseeded = tmp_path / "copy", str(tmp_path / "reseeded")
    shutil.copytree(glm_ckpt[0], copy)  # the same checkpoint elsewhere: a path may differ between nodes
    save_reference_checkpoint(reseeded, "glm_moe_dsa", seed=1)  # the same shapes, other weights
    for extra, path, words in ((["--enable-expert-parallel"], str(copy), "enable_expert_parallel True against False"),
                               ([], reseeded, "another checkpoint")):
        port = free_port()
        node1 = subprocess.Popen([sys.executable, "-m", "sparsekv", "serve", path, "--node-rank", "1", "--kv-page-size",
                                  "4", "--max-model-len", "128", "-tp", "2", "--nnodes", "2", "--dist-init-addr",
                                  f"127.0.0.1:{port}", *STARTUP_FLAGS, *extra], env={**os.environ, "PYTHONPATH": REPO},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            with pytest.raises(StartupError, match=f"rank 1 was started with other options.*{words}"):
                LLM(glm_ckpt[0], **BASE, tensor_parallel_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
            # exit 1, as docs/parallel.md says: not a C++ abort of a group torn down while its peers leave
            assert node1.wait(timeout=60) == 1
            assert "terminate called" not in node1.stdout.read()
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.wait()


def test_each_rank_reports_its_weights_memory_and_collective_bytes(glm_ckpt):
    """Counts, not timings: each of the L layers all-reduces its attention and FFN outputs and the
    embedding one more time, [rows, hidden] fp32 each; a ring all-reduce sends 2 (N-1)/N of it per
    rank. The lm_head all-gathers each sampled row's vocab/N logits to N-1 ranks. Weight bytes per
    rank are what the planner's sizing says for the layout."""
    from sparsekv.cache.sizing import Parallelism, weight_bytes_per_rank
    from sparsekv.config import ModelConfig
    path, prompts = glm_ckpt[0], _prompts(256)
    cfg = ModelConfig.from_json(path)
    llm = LLM(path, **BASE, tensor_parallel_size=2)
    try:
        llm.generate(prompts, PARAMS)
        ranks = llm.stats()["ranks"]
    finally:
        llm.close()
    assert [r["rank"] for r in ranks] == [0, 1]
    rows = sum(len(p) + PARAMS.max_tokens - 1 for p in prompts)  # the last sampled token is never fed
    n, fp32 = 2, 4
    all_reduce = (2 * cfg.num_hidden_layers + 1) * rows * cfg.hidden_size * fp32 * 2 * (n - 1) // n
    all_gather = len(prompts) * PARAMS.max_tokens * cfg.vocab_size // n * fp32 * (n - 1)
    for r in ranks:
        assert r["bytes_sent"] == {"all_reduce": all_reduce, "all_gather": all_gather}
        assert r["peak_rss_bytes"] > r["weight_bytes"] > 0
    planned = weight_bytes_per_rank(cfg, Parallelism(tp=2, dp=1, ep=False), "fp32")
    assert [r["weight_bytes"] for r in ranks] == [planned.total] * 2
    # the KV cache is whole on every tensor rank: what sizing (and so the planner) counts per token
    from sparsekv.cache.sizing import index_bytes_per_token, latent_bytes_per_token
    per_token = latent_bytes_per_token(cfg, cfg.latent_dim * fp32) + index_bytes_per_token(cfg, "fp32")
    slots = llm.engine.kv.allocator.num_pages * llm.engine.kv.page_size
    assert [r["kv_pool_bytes"] for r in ranks] == [slots * per_token] * 2


@pytest.mark.parametrize("tier", ["host", "disk", "host-quest"])
def test_prefix_cache_hits_from_rank_0s_host_and_disk_tiers_reach_every_rank(glm_ckpt, tmp_path, tier):
    """Only rank 0 has the prefix cache's lower tiers: the pages a hit restores there are broadcast to
    every rank before the step (SchedulerOutput.restored_page_ids). Released pages go straight to the
    tier (no pool pages kept per tenant), so the second run of the prompt is served from it. With Quest,
    its page bounds (one row per 2 tokens, two rows per KV page) are restored and broadcast too."""
    options = dict(prefix_cache_max_pages_per_tenant=0)
    if tier.endswith("-quest"):
        tier = tier.removesuffix("-quest")
        options.update(selector="quest", quest_page_tokens=2)
    if tier == "host":
        options["prefix_cache_host_bytes"] = 1 << 24
    else:
        options.update(prefix_cache_disk_bytes=1 << 24, prefix_cache_disk_unencrypted=True)
    prompt = _prompts(256)[0]
    prompts = [prompt, prompt + [5, 6, 7]]

    def run(path_suffix, **extra):
        if tier == "disk":
            extra["prefix_cache_disk_path"] = str(tmp_path / path_suffix)
        llm = LLM(glm_ckpt[0], **BASE, **options, **extra)
        try:
            return [llm.generate([p], PARAMS)[0] for p in prompts], llm
        finally:
            llm.close()
    want, single = run("one")
    got, llm = run("tp", tensor_parallel_size=2)
    assert got[1].metrics[f"prefix_cached_tokens_{tier}"] == want[1].metrics[f"prefix_cached_tokens_{tier}"] >= 32
    assert_same_greedy(want, got, logprob_tolerance(single))


def _compare_data_parallel(path: str, prompts: list[list[int]], tol_model=None, **options) -> None:
    single = LLM(path, **BASE, **{k: v for k, v in options.items() if k not in ("enable_expert_parallel",
                                                                               "decode_graphs")})
    want = single.generate(prompts, PARAMS)
    llm = LLM(path, **BASE, data_parallel_size=2, **options)
    try:
        got = llm.generate(prompts, PARAMS)
        llm.engine.check_integrity()
        stats = llm.stats()
    finally:
        llm.close()
    assert not _rank_processes(), "close() left a worker running"
    tol = logprob_tolerance(single, extra_layers=1 if options.get("num_speculative_tokens") else 0)
    assert_same_greedy(want, got, tol)
    by_rank = stats["by_data_parallel_rank"]
    assert all(r["generation_tokens"] > 0 for r in by_rank), f"one rank got no request: {by_rank}"
    assert stats["generation_tokens"] == sum(len(o.token_ids) for o in got)
    assert [r["rank"] for r in stats["ranks"]] == [0, 1]
    if options.get("enable_expert_parallel"):
        whole = single.engine.model.weight_bytes
        assert all(r["weight_bytes"] < whole for r in stats["ranks"]), "expert parallelism spreads the experts"
        assert all(r["bytes_sent"]["moe_all_gather"] > 0 for r in stats["ranks"])
    if options.get("decode_graphs") == "eager":  # every rank's decode steps through the pieces
        assert all(r["decode_graph_steps"] > 0 for r in by_rank), by_rank
        if options.get("num_speculative_tokens"):
            assert stats["decode_graph_extend_steps"] > 0 and stats["decode_graph_draft_steps"] > 0


def _rank_processes() -> list:
    import multiprocessing
    return [p for p in multiprocessing.active_children() if p.name.startswith("sparsekv-rank")]


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [dict(enable_expert_parallel=True), {},
                                     dict(enable_expert_parallel=True, kv_tiering=True, device_buffer_tokens=16),
                                     dict(enable_expert_parallel=True, selector="quest", quest_page_tokens=2),
                                     dict(enable_expert_parallel=True, decode_graphs="eager"),
                                     dict(decode_graphs="eager"),
                                     dict(enable_expert_parallel=True, kv_tiering=True, device_buffer_tokens=16,
                                          decode_graphs="eager")],
                         ids=["ep", "replicas", "ep-tiered", "ep-quest", "ep-decode-graphs", "replicas-decode-graphs",
                              "ep-tiered-decode-graphs"])
def test_data_parallel_attention_equals_one_process(family, options, glm_ckpt, ds_ckpt):
    """Each data-parallel rank serves its own requests from its own cache; with expert parallelism the
    ranks' tokens meet at every MoE layer (all-gather, own experts, reduce-scatter), the rank without
    rows in a pass taking part with none. With the decode graphs every rank's decode steps run as the
    pieces (with expert parallelism, of the bucket the ranks agree on, a rank without rows over padding
    rows), against one process's engine path: five requests, so the ranks' own buckets differ (two and
    four rows) and the one they agree on is the wider."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    g = torch.Generator().manual_seed(11)
    lengths = (25, 4, 17) if "decode_graphs" in options else (25, 4)
    prompts = _prompts(256) + [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]
    _compare_data_parallel(path, prompts, **options)


@pytest.mark.parametrize("selector", ["dsa", "quest"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_data_parallel_expert_parallel_mtp_drafting_through_the_decode_pieces_equals_one_process(family, selector,
                                                                                                 glm_ckpt, ds_ckpt,
                                                                                                 tmp_path):
    """With MTP drafting (K = 2) every pass of a step (the target's, the extend pass, draft step 2) is
    agreed on by the ranks: each through the pieces of the widest rank's bucket, a rank without rows
    over padding rows, or every rank on the engine's path; against one process drafting on its
    engine's path. With Quest too (pages of 2 tokens: each rank rewinds its own requests' pages)."""
    quest = dict(selector="quest", quest_page_tokens=2) if selector == "quest" else {}
    src = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    path = _with_mtp_layer(src, str(tmp_path / family), own_embed_and_head=family == "ds")
    g = torch.Generator().manual_seed(11)
    prompts = _prompts(256) + [torch.randint(1, 256, (n,), generator=g).tolist() for n in (25, 4, 17)]
    options = dict(enable_expert_parallel=True, num_speculative_tokens=2, decode_graphs="eager", **quest)
    _compare_data_parallel(path, prompts, **options)
    # rank 0's request done after its first tokens, rank 1's drafts on alone: rank 0 runs every pass's
    # pieces over padding rows (the extend pass and draft step 2 too)
    short, long = _prompts(256)[1], _prompts(256)[0]
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=3, ignore_eos=True) for n in (2, 16)]
    single = LLM(path, **BASE, num_speculative_tokens=2, **quest)
    want = single.generate([short, long], params)
    llm = LLM(path, **BASE, data_parallel_size=2, **options)
    try:
        got = llm.generate([short, long], params)
        by_rank = llm.stats()["by_data_parallel_rank"]
    finally:
        llm.close()
    assert [r["generation_tokens"] for r in by_rank] == [2, 16] and by_rank[1]["decode_graph_steps"] >= 4
    assert_same_greedy(want, got, logprob_tolerance(single, extra_layers=1))


def test_data_parallel_with_mtp_drafting_and_tiering_on_the_bundled_model():
    prompts = _prompts(4096) + [[7, 8, 9] * 11]
    _compare_data_parallel(default_model_path(), prompts, enable_expert_parallel=True, kv_tiering=True,
                           num_speculative_tokens=2)


@pytest.mark.parametrize("graphs", ["off", "eager"], ids=["", "decode-graphs"])
def test_expert_parallel_with_rank_1_wider_than_rank_0_and_then_alone_equals_one_process(glm_ckpt, graphs):
    """The ranks' rows meet at each MoE layer, each rank's padded to the widest rank's count: here rank 1
    has more rows than rank 0 (the longer prompt went there), then decodes alone while rank 0, done,
    takes part with none. Each rank gets back exactly its own rows' expert outputs. With the decode
    graphs rank 1 decodes alone through the pieces while rank 0 runs them over padding rows only (their
    MoE exchanges, of fixed shapes, would not pair up otherwise)."""
    short, long = _prompts(256)[1], _prompts(256)[0]
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=3, ignore_eos=True) for n in (2, 10)]
    single = LLM(glm_ckpt[0], **BASE)
    want = single.generate([short, long], params)
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, enable_expert_parallel=True, decode_graphs=graphs)
    try:
        got = llm.generate([short, long], params)
        stats = llm.stats()
        by_rank = stats["by_data_parallel_rank"]
        llm.engine.check_integrity()
    finally:
        llm.close()
    assert [(r["prompt_tokens"], r["generation_tokens"]) for r in by_rank] == [(len(short), 2), (len(long), 10)]
    assert_same_greedy(want, got, logprob_tolerance(single))
    from sparsekv.parallel.lanes import RANK_MEMORY
    for key in set(RANK_MEMORY) & set(stats):  # each rank's memory apart, adding up to the engine's
        assert sum(r[key] for r in by_rank) == stats[key], key
    assert "kv_pages_free" in stats and by_rank[0]["kv_pages_total"] == single.stats()["kv_pages_total"]
    assert 0 < by_rank[0]["prefix_cached_pages"] < by_rank[1]["prefix_cached_pages"]  # rank 1 kept the longer prompt
    if graphs == "eager":  # rank 0's one decode step with rank 1's, then rank 1's eight alone
        assert [r["decode_graph_steps"] for r in by_rank] == [1, 9]


def test_each_data_parallel_rank_keeps_its_prefix_cache_disk_tier_in_a_directory_of_its_own(glm_ckpt, tmp_path):
    """Each rank's engine has its own prefix cache: its disk tier lives in `dp<rank>` under the given
    directory (one directory shared by two caches would mix their files), and a restarted engine serves
    each rank's prompt from that rank's files."""
    prompts = _prompts(256)
    options = dict(prefix_cache_max_pages_per_tenant=0, prefix_cache_disk_bytes=1 << 24,
                   prefix_cache_disk_unencrypted=True, prefix_cache_disk_path=str(tmp_path))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for run in range(2):
        llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, **options)
        try:
            got = llm.generate(prompts, params)
        finally:
            llm.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dp0", "dp1"]
        assert all(any((tmp_path / d).iterdir()) for d in ("dp0", "dp1"))
    assert all(o.metrics["prefix_cached_tokens_disk"] >= 4 for o in got)  # each prompt's pages, on its rank


def test_data_parallel_routes_a_repeated_prompt_to_the_rank_holding_its_prefix(glm_ckpt):
    prompt = _prompts(256)[0]
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, enable_expert_parallel=True)
    try:
        first = llm.generate([prompt, [9] * 30], PARAMS)
        again = llm.generate([[9] * 30, prompt], PARAMS)
    finally:
        llm.close()
    assert first[0].num_cached_tokens == 0
    assert again[1].metrics["prefix_cached_tokens_device"] == again[1].num_cached_tokens >= 32
    assert again[0].num_cached_tokens >= 28


def test_a_request_on_another_rank_is_first_scheduled_in_the_step_that_ran_it(glm_ckpt):
    """Rank 0's view of a request on rank 1 (what the server's queue and prefill figures read) takes
    the start of the step in which rank 1 first scheduled it: the first step for the first, a step
    after the first finished for the one queued behind it (one sequence per rank)."""
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, max_num_seqs=1)
    engine = llm.engine
    try:
        prompts = [_prompts(256)[0][i:i + 30] for i in range(4)]
        requests = [engine.add_request(f"r{i}", prompt, PARAMS) for i, prompt in enumerate(prompts)]
        remote = [r for r in requests if engine.rank_of[r.request_id] == 1]
        assert len(remote) == 2 and all(r.first_scheduled_time is None for r in remote)
        steps, finished = [], {}
        while engine.has_unfinished_requests():
            before = time.monotonic()
            outs = engine.step()
            steps.append((before, time.monotonic()))
            finished.update({o.request_id: len(steps) - 1 for o in outs if o.finished})
        step_of = [next(i for i, (a, b) in enumerate(steps) if a <= r.first_scheduled_time <= b) for r in remote]
        assert step_of[0] == 0 and step_of[1] == finished[remote[0].request_id] + 1
        assert not engine._remote
        engine.check_integrity()
    finally:
        llm.close()


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2), dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, decode_graphs="eager")],
                         ids=["dp2-ep", "tp2-ep", "tp2-ep-decode-graphs"])
def test_routed_experts_under_expert_parallelism_are_one_processes(glm_ckpt, layout):
    """return_routed_experts with the experts spread over the ranks: every rank's router is the same, and
    each request's recorded rows are its own (with data-parallel attention every rank routes all ranks'
    rows at each MoE layer, its own among them); the experts of each token are one process's. With the
    decode graphs, a step that records takes the engine's decode path on every rank, not on rank 0 alone
    (the ranks' collectives would not pair up: 3 requests, padded to 4 in the pieces)."""
    prompts = _prompts(256) + ([_prompts(256)[1][:7]] if "decode_graphs" in layout else [])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    want = LLM(glm_ckpt[0], **BASE).generate(prompts, params)
    llm = LLM(glm_ckpt[0], **BASE, enable_expert_parallel=True, **layout)
    try:
        got = llm.generate(prompts, params)
        if "data_parallel_size" in layout:
            assert all(r["generation_tokens"] > 0 for r in llm.stats()["by_data_parallel_rank"])  # a prompt per rank
    finally:
        llm.close()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.routed_experts) == len(g.token_ids)
        assert g.routed_experts == w.routed_experts


def test_layer_taps_turn_every_rank_s_decode_graphs_off(glm_ckpt):
    """A tensor-parallel prefill worker's layer taps (rank 0's) turn the decode graphs off on every rank,
    so the ranks' decode steps take the same path (3 requests: 4 rows in the pieces, 3 on the engine's
    path, collectives that would not pair up) and decode as one process does."""
    prompts = _prompts(256) + [_prompts(256)[1][:7]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = LLM(glm_ckpt[0], **BASE).generate(prompts, params)
    llm = LLM(glm_ckpt[0], **BASE, tensor_parallel_size=2, decode_graphs="eager")
    try:
        llm.engine.executor.layer_taps(llm.engine.kv.page_tensors())
        got = llm.generate(prompts, params)
        assert llm.engine.executor.runner.graphs is None and "decode_graph_steps" not in llm.stats()
    finally:
        llm.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_data_parallel_front_end_refuses_counts_and_aborts_requests_no_rank_has_seen(glm_ckpt):
    """Before a step sends them: a request id in use is refused with nothing routed or counted; the waiting requests are counted once per rank (rank 0's
    from its engine, the others' from their last answer and the adds still to send), per tenant too; a
    request aborted before a step sent it leaves nothing to send."""
    from sparsekv.request import InvalidRequest
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, enable_expert_parallel=True, max_num_seqs=1)
    engine, router = llm.engine, llm.engine.router
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (13,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        for i in range(4):
            engine.add_request(f"r{i}", prompts[i], params, tenant="a" if i < 2 else "b")
        assert [engine.rank_of[f"r{i}"] for i in range(4)] == [0, 1, 0, 1]
        with pytest.raises(InvalidRequest, match="already in use"):
            engine.add_request("r1", prompts[4], params)
        assert router.in_flight == [2, 2]
        assert (engine.num_waiting_requests(), engine.num_waiting_requests("a"), engine.num_waiting_requests("b")) == (4, 2, 2)
        engine.step()  # one sequence per rank: each runs its tenant a request, holds its tenant b one
        assert (engine.num_waiting_requests(), engine.num_waiting_requests("a"), engine.num_waiting_requests("b")) == (2, 0, 2)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("p", prompts[4], params)
        engine.add_request("q", prompts[5], params)
        assert engine.rank_of == {"p": 0, "q": 1}
        assert engine.abort("p") and engine.abort("q")
        assert not engine.has_unfinished_requests() and router.in_flight == [0, 0]
        engine.check_integrity()
    finally:
        llm.close()


def test_a_paused_data_parallel_engine_counts_the_requests_routed_to_each_rank_as_waiting(glm_ckpt):
    """A request for rank 1 goes there with the next step, and a paused engine sends none: its figures
    still count it waiting (they read 0, so /metrics, the PD router's load and a client waiting for
    the queue saw an empty engine), in the sum and on its rank, by tenant; it leaves the count when
    aborted before it went."""
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2)
    engine = llm.engine
    try:
        engine.pause_generation()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        for i, prompt in enumerate(_prompts(256)):
            engine.add_request(f"r{i}", prompt, params, tenant="alice" if i else "default")
        assert engine.rank_of == {"r0": 0, "r1": 1}
        stats = engine.stats()
        assert stats["waiting"] == 2 == engine.num_waiting_requests()
        assert [r["waiting"] for r in stats["by_data_parallel_rank"]] == [{"default": 1}, {"alice": 1}]
        assert engine.abort("r1")
        assert engine.stats()["waiting"] == 1
        engine.continue_generation()
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats()["waiting"] == 0
        engine.check_integrity()
    finally:
        llm.close()


def test_an_abort_reaches_its_rank_without_another_request(glm_ckpt):
    """Aborting the requests of rank 1 leaves work for the engine loop: the next step sends the aborts,
    and that rank frees their pages and stops counting them, with no other request to step for."""
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2)
    engine = llm.engine
    try:
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(_prompts(256)):
            engine.add_request(f"r{i}", prompt, params)
        assert sorted(engine.rank_of.values()) == [0, 1]
        engine.step()
        assert engine.stats()["running"] == 2
        for request_id in list(engine.rank_of):
            engine.abort(request_id)
        assert engine.has_unfinished_requests()  # rank 1's abort is not sent yet
        while engine.has_unfinished_requests():
            engine.step()
        stats = engine.stats()
        assert stats["running"] == stats["waiting"] == 0 and engine.num_waiting_requests() == 0
        assert [(r["running"], sum(r["waiting"].values())) for r in stats["by_data_parallel_rank"]] == [(0, 0), (0, 0)]
        engine.check_integrity()
    finally:
        llm.close()



def test_an_idle_data_parallel_engine_forgets_every_ranks_pages_past_the_retention(glm_ckpt):
    """`prefix_cache_ttl_s` bounds how long a tenant's prompt stays cached: with no step to run, the
    server's idle call `expire_prefix_cache` forgets the pages past it on every rank, rank 1's too, and
    answers how many. Waits past a short retention, so every page is past it whatever the machine."""
    ttl = 0.2
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, prefix_cache_ttl_s=ttl)
    engine = llm.engine
    try:
        llm.generate(_prompts(256), PARAMS)
        cached = [r["prefix_cached_pages"] for r in engine.stats()["by_data_parallel_rank"]]
        assert all(n > 0 for n in cached), cached  # a prompt on each rank
        time.sleep(2 * ttl)
        assert engine.expire_prefix_cache() == sum(cached)
        assert [r["prefix_cached_pages"] for r in engine.stats()["by_data_parallel_rank"]] == [0, 0]
        engine.check_integrity()
    finally:
        llm.close()


def test_a_rank_counts_its_requests_in_flight_until_they_finish_are_aborted_or_an_update_aborts_them(glm_ckpt):
    """The router's count of requests in flight per rank (`PrefixAffinityRouter.in_flight`) goes back to 0
    when a request finishes, when it is aborted (sent to its rank, or still queued for it) and when a
    weight update with policy "abort" ends it; each time the next request goes to the least loaded
    rank. A count that stayed up sent every later request away from that rank."""
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2)
    engine, router = llm.engine, llm.engine.router
    g = torch.Generator().manual_seed(11)
    prompts = iter([torch.randint(1, 256, (13,), generator=g).tolist() for _ in range(12)])  # no page shared
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def add(request_id: str, params: SamplingParams = long) -> int:
        engine.add_request(request_id, next(prompts), params)
        return engine.rank_of[request_id]
    try:
        assert [add(f"f{i}", short) for i in range(3)] == [0, 1, 0] and router.in_flight == [2, 1]
        while engine.has_unfinished_requests():
            engine.step()
        assert router.in_flight == [0, 0]
        assert [add("a0"), add("a1"), add("a2")] == [0, 1, 0]  # each to the least loaded, the lowest of equals
        engine.step()  # started on their ranks
        assert engine.abort("a0") and engine.abort("a2") and router.in_flight == [0, 1]
        assert add("a3") == 0 and router.in_flight == [1, 1]  # rank 0 is the less loaded again
        assert add("a4") == 0 and add("a5") == 1 and router.in_flight == [2, 2]
        assert engine.abort("a5") and engine.abort("a3") and engine.abort("a4")  # a5 before a step sent it
        assert router.in_flight == [0, 1] and not engine.abort("a5")  # an abort counts once
        assert add("a6") == 0 and router.in_flight == [1, 1]
        outs = engine.step()
        assert engine.abort("a1") and router.in_flight == [1, 0]  # its abort waits for the next step
        aborted = engine.update_weights_from_disk(glm_ckpt[0], policy="abort")  # ends a1 on rank 1 too
        assert [o.request_id for o in aborted] == ["a6"] and router.in_flight == [0, 0]  # a1 is not counted twice
        assert add("u0") == 0 and add("u1") == 1
        engine.abort("u0")
        engine.abort("u1")
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert router.in_flight == [0, 0] and not engine.rank_of
        assert "a5" not in {o.request_id for o in outs}  # never sent to its rank
        engine.check_integrity()
    finally:
        llm.close()


def test_a_request_with_a_logits_processor_runs_on_rank_0(glm_ckpt):
    """A logits processor is a Python callable given in this process (a closure here, which no other
    process could load): its requests run on rank 0, with the others spread as usual, and answer as
    one process does."""
    long, short = _prompts(256)
    prompts = [long, short, long[5:], short[3:]]
    single = LLM(glm_ckpt[0], **BASE)
    banned = single.generate(prompts[1:2], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]

    def ban(token_ids, logits):
        logits[banned] = float("-inf")
        return logits
    params = [SamplingParams(max_tokens=6, temperature=0.0, logits_processors=[ban] if i % 2 else None)
              for i in range(4)]
    want = single.generate(prompts, params)
    assert want[1].token_ids[0] != banned
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2)
    try:
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert llm.engine.stats()["by_data_parallel_rank"][1]["generation_tokens"] > 0  # the others spread
        again = llm.generate(prompts[:1], params[:1])  # the engine serves on
        assert again[0].token_ids == want[0].token_ids
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_router_prefers_the_longest_cached_prefix_then_the_least_loaded():
    from sparsekv.parallel.router import PrefixAffinityRouter
    router = PrefixAffinityRouter(num_ranks=2, page_size=4)
    a, b = list(range(1, 13)), list(range(50, 62))
    assert router.choose(a) == 0 and router.choose(b) == 1  # nothing cached: the least loaded, then the lowest
    assert router.choose(a + [99]) == 0  # three pages cached on rank 0
    assert router.choose(b[:8] + [7, 7, 7, 7]) == 1  # two on rank 1 beat none on rank 0, though rank 1 is busier
    assert router.choose(a, tenant="other") == 0 and router.in_flight == [3, 2]  # another tenant: no match
    assert router.choose(a, cache_salt="s") == 1  # a salt is its own namespace: rank 1 is now less loaded
    router.finished(0)
    assert router.in_flight == [2, 3]
    assert router.choose(list(range(200, 203))) == 0  # shorter than a page: by load alone


def test_router_spreads_prompts_sharing_a_prefix_once_one_rank_is_busier():
    """Chat traffic shares its first pages (a system prompt): affinity holds while the rank holding them
    has at most BALANCE_SLACK more requests in flight than the least loaded, then the least loaded rank
    takes one, holds the shared pages too, and load decides between equals (all 16 went to rank 0)."""
    from sparsekv.parallel.router import BALANCE_SLACK, PrefixAffinityRouter
    router = PrefixAffinityRouter(num_ranks=2, page_size=4)
    system = list(range(1, 9))
    ranks = [router.choose(system + [100 + i, 7, 7, 7]) for i in range(16)]
    assert ranks[:BALANCE_SLACK + 1] == [0] * (BALANCE_SLACK + 1) and ranks[BALANCE_SLACK + 1] == 1
    assert router.in_flight == [8, 8]
    for _ in range(8):
        router.finished(1)
    assert router.choose(system + [5, 5, 5, 5]) == 1  # the shared pages are on both: the less loaded
    big = PrefixAffinityRouter(num_ranks=2, page_size=4)
    big.in_flight = [100, 90]
    big.assign(0, system)  # rank 0 holds the prefix with 101 in flight: within 1.25 x 90
    assert big.peek(system) == 0
    big.in_flight = [120, 90]
    assert big.peek(system) == 1


def test_router_counts_only_whole_pages_of_a_prompt():
    from sparsekv.parallel.router import PrefixAffinityRouter
    router = PrefixAffinityRouter(num_ranks=2, page_size=4)
    assert [len(router.chain(list(range(n)), "t", None)) for n in (3, 4, 7, 8, 9)] == [0, 1, 1, 2, 2]
    router.assign(1, [1, 2, 3, 4])  # exactly one page: remembered on rank 1
    router.finished(1)
    assert router.peek([1, 2, 3, 4, 5]) == 1


def test_router_remembers_at_most_max_pages_per_rank_least_recently_used_first_out():
    from sparsekv.parallel.router import PrefixAffinityRouter
    router = PrefixAffinityRouter(num_ranks=2, page_size=2, max_pages_per_rank=4)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]  # two pages each

    def held(prompt):
        return router.matched_pages(0, router.chain(prompt, "default", None))
    router.assign(0, a)
    router.assign(0, b)
    router.assign(0, a)  # a used again: b's pages are now the least recently used
    router.assign(0, c)  # two more pages than fit: b's go
    assert (held(a), held(b), held(c)) == (2, 0, 2) and len(router.seen[0]) == 4


def test_the_ranks_stats_add_up_and_their_rates_are_recomputed_from_the_sums():
    """Counts add up (per-position lists element by element, per-tenant dicts key by key, a tenant only
    one rank saw included), settings and names are rank 0's, each rank's own figures are listed, and
    every rate is the sums' ratio, not a sum or a mean of the ranks' rates."""
    from sparsekv.parallel.lanes import merge_stats

    def rank(n, hits, queries, accepted, drafts, per_pos, tenants, misses):
        return {"running": n, "device_buffer_tokens": 16, "dtype": "float32", "paused": False, "ranks": [{"rank": n}],
                "prefix_cache_hits_device": hits, "prefix_cache_hits_host": 1, "prefix_cache_queries": queries,
                "prefix_cache_hit_rate": (hits + 1) / queries, "prefix_cache_by_tenant": tenants,
                "spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": 2 * drafts,
                "spec_decode_num_accepted_tokens": accepted, "spec_decode_num_accepted_tokens_per_pos": per_pos,
                "spec_decode_acceptance_rate": accepted / (2 * drafts),
                "spec_decode_mean_acceptance_length": 1 + accepted / drafts,
                "tier_hits": 3, "tier_misses": misses, "tier_miss_rate": misses / (3 + misses)}
    merged = merge_stats([rank(0, 3, 8, 3, 2, [2, 1], {"a": {"served": 4}}, 1),
                          rank(1, 0, 32, 1, 8, [1, 0], {"a": {"served": 1}, "b": {"served": 2}}, 9)])
    assert merged["running"] == 1 and merged["device_buffer_tokens"] == 16 and merged["dtype"] == "float32"
    assert merged["ranks"] == [{"rank": 0}, {"rank": 1}]
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [3, 1]
    assert merged["prefix_cache_by_tenant"] == {"a": {"served": 5}, "b": {"served": 2}}
    assert merged["prefix_cache_hit_rate"] == (3 + 1 + 0 + 1) / 40
    assert merged["spec_decode_acceptance_rate"] == 4 / 20
    assert merged["spec_decode_mean_acceptance_length"] == 1 + 4 / 10
    assert merged["tier_miss_rate"] == 10 / 16


def test_merged_stats_keep_rank_0s_flags_and_no_acceptance_length_without_drafts():
    """A flag is a setting, rank 0's (True on every rank stays True, not a count of ranks); with no draft
    on any rank the merged drafting figures are what one engine without a draft reports (a mean
    acceptance length of 0.0, not 1.0)."""
    from sparsekv.parallel.lanes import merge_stats
    from sparsekv.speculative import SpecDecodingCounts

    def rank(flag):
        return {"paused": flag, "weight_update_pending": flag, **SpecDecodingCounts(k=2).metrics()}
    merged = merge_stats([rank(True), rank(True)])
    assert merged["paused"] is True and merged["weight_update_pending"] is True
    assert merge_stats([rank(False), rank(False)])["paused"] is False
    assert {k: v for k, v in merged.items() if k.startswith("spec_decode")} == SpecDecodingCounts(k=2).metrics()


def test_a_rank_reports_its_broken_integrity_by_number_and_a_sound_one_nothing():
    """`lane_integrity` is each rank's part of `DataParallelEngine.check_integrity`: a rank's failed
    check comes back as a problem naming the rank, which the front end asserts on; a rank that
    swallowed it would let a data-parallel engine pass its integrity check with a broken rank."""
    from types import SimpleNamespace

    from sparsekv.parallel.lanes import lane_integrity

    def lane(rank: int, problem: str | None):
        def check_integrity():
            if problem is not None:
                raise AssertionError(problem)
        return SimpleNamespace(check_integrity=check_integrity,
                               executor=SimpleNamespace(model=SimpleNamespace(comm=SimpleNamespace(rank=rank))))
    assert lane_integrity(lane(1, "a named page is free")) == "data-parallel rank 1: a named page is free"
    assert lane_integrity(lane(1, None)) is None


def test_serve_with_data_parallel_attention_and_expert_parallelism():
    """`sparsekv serve -dp 2 --enable-expert-parallel` answers the OpenAI API: two requests, one per rank."""
    import httpx

    from test_server_util import start_subprocess_server, wait_healthy
    proc, url = start_subprocess_server(default_model_path(), "-dp", "2", "--enable-expert-parallel")
    try:
        wait_healthy(url, proc, timeout=120)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for prompt in ("def fibonacci(n):", "import os"):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                          "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(url + "/metrics").text
        assert 'sparsekv:rank_weight_bytes{model_name=' in metrics and 'rank="1"' in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_tensor_parallel_fp8_cache_and_structured_output_equal_one_process():
    """FP8 latents are written by every rank from the same (all-reduced) hidden states; structured
    outputs are decided on rank 0 from the all-gathered logits (the bundled model: it has a tokenizer)."""
    from sparsekv.sampling_params import SamplingParams as Params
    prompts = _prompts(4096)
    choice = Params(max_tokens=8, temperature=0.0, structured_output={"type": "choice", "choices": ["yes", "no"]})
    results = []
    for options in ({}, dict(tensor_parallel_size=2)):
        llm = LLM(default_model_path(), **BASE, kv_cache_dtype="fp8", **options)
        try:
            results.append((llm.generate(prompts, PARAMS), llm.generate(["Answer:"], choice)[0].text, llm))
        finally:
            llm.close()
    (want, want_choice, single), (got, got_choice, _) = results
    assert_same_greedy(want, got, logprob_tolerance(single))
    assert got_choice == want_choice and got_choice in ("yes", "no")


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_each_rank_loads_exactly_its_slice_of_an_fp8_checkpoint(glm_ckpt, tmp_path, expert_parallel):
    """Every tensor a rank loads equals its slice of the whole dequantized tensor, bit for bit: FP8 block
    scales follow their blocks wherever a slice starts (here inside a 128-row block, and at 128)."""
    from test_engine import QUANTIZED, _quantize

    from sparsekv.config import ModelConfig
    from sparsekv.model.checkpoint import load_tensors
    from sparsekv.parallel.layout import ParallelLayout
    path = tmp_path / "fp8"
    shutil.copytree(glm_ckpt[0], path)
    tensors = load_file(path / "model.safetensors")
    for name in list(tensors):
        if any(f"{q}.weight" in name for q in QUANTIZED) or name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name], tensors[name + "_scale_inv"] = _quantize(tensors[name])
    save_file(tensors, path / "model.safetensors")
    cfg = ModelConfig.from_json(str(path))
    whole = load_tensors(str(path), cfg, torch.float32, torch.device("cpu"))
    assert any(n.endswith("q_b_proj.weight") for n in whole) and "lm_head.weight" in whole
    split = 0
    for rank in (0, 1):
        layout = ParallelLayout(2, 1, expert_parallel, rank)
        mine = load_tensors(str(path), cfg, torch.float32, torch.device("cpu"), layout=layout)
        for name, t in whole.items():
            if not layout.holds(name, cfg):
                assert name not in mine
                continue
            shard = layout.shard(name, tuple(t.shape))
            want = t if shard is None else (t[shard[1]:shard[2]] if shard[0] == 0 else t[:, shard[1]:shard[2]])
            split += shard is not None
            assert torch.equal(mine[name], want), f"rank {rank}: {name}"
    assert split > 0


@pytest.mark.parametrize("launcher", ["nnodes", "torchrun"])
def test_serve_across_two_launched_processes(launcher):
    """`sparsekv serve` as node 0 of `--nnodes 2` (node 1: `serve --node-rank 1`), or as rank 0 of a world
    torchrun started (rank 1: the same command with RANK=1): the API answers with the one-process tokens."""
    import subprocess
    import sys

    import httpx

    from test_server_util import REPO, free_port, serve_subprocess, tiny_checkpoint, wait_healthy
    model = tiny_checkpoint(Path(tempfile.mkdtemp()))
    addr = f"127.0.0.1:{free_port()}"  # NOTE: the configured rendezvous address is what this test is about
    common = [sys.executable, "-m", "sparsekv", "serve", model, "-tp", "2", "--kv-page-size", "16",
              "--max-model-len", "256", "--log-level", "warning", *STARTUP_FLAGS]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    if launcher == "nnodes":
        dist = ["--nnodes", "2", "--dist-init-addr", addr]
        envs = [env, env]
        cmds = [common + dist, common + dist + ["--node-rank", "1"]]
    else:
        host, master_port = addr.split(":")
        torchrun = dict(WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=host, MASTER_PORT=master_port)
        envs = [{**env, **torchrun, "RANK": "0"}, {**env, **torchrun, "RANK": "1"}]
        cmds = [common, common]
    node0, url = serve_subprocess(cmds[0], envs[0])
    procs = [node0, subprocess.Popen(cmds[1], env=envs[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    prompt = [5, 17, 33, 2, 9, 41, 7, 12]
    want = LLM(model, kv_page_size=16, max_model_len=256).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    try:
        wait_healthy(url, procs[0], timeout=120)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
        procs[0].terminate()
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0], "\n".join(f"node {i} (exit {c}):\n{p.stdout.read()}" for i, (p, c) in enumerate(zip(procs, codes)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_engine_failing_after_its_ranks_started_stops_them(glm_ckpt):
    """Drafting asked of a checkpoint without an MTP layer fails once the model is loaded, after the
    ranks started: the error is the ConfigError, every worker stops, and the next engine can start."""
    with pytest.raises(ConfigError, match="needs a checkpoint with an MTP layer"):
        LLM(glm_ckpt[0], **BASE, tensor_parallel_size=2, num_speculative_tokens=2)
    assert not _rank_processes()
    llm = LLM(glm_ckpt[0], **BASE, tensor_parallel_size=2)
    try:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        llm.close()


def test_an_engine_that_fails_to_build_after_its_ranks_started_stops_them(glm_ckpt, tmp_path, monkeypatch):
    """An option found wrong once the ranks are up (a tokenizer asked for and not there): the error
    comes back and the worker ranks it started have exited, none left running."""
    from sparsekv.parallel import launch
    started, real_start = [], launch.RankGroup.start.__func__

    def start(cls, config, worker_main):
        started.append(real_start(cls, config, worker_main))
        return started[-1]
    monkeypatch.setattr(launch.RankGroup, "start", classmethod(start))
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        LLM(glm_ckpt[0], **BASE, tensor_parallel_size=2, tokenizer=str(empty))
    assert len(started) == 1 and started[0].processes
    assert all(not p.is_alive() for p in started[0].processes), "a failed build left a worker running"


class _TwoRanksAlike:
    """torch.distributed's collectives as two ranks holding the same rows would see them, in one
    process: an all-gather repeats this rank's part, a reduce-scatter sums the two halves' parts."""

    def __init__(self):
        self.gathered: list[int] = []  # the size of each all-gather's part

    def all_gather_single(self, out, part, group=None):
        self.gathered.append(part.numel())
        out.copy_(torch.cat([part, part]))

    def reduce_scatter_single(self, out, whole, group=None):
        half = whole.shape[0] // 2
        out.copy_(whole[:half] + whole[half:])


def test_an_expert_exchange_of_an_agreed_bucket_sends_no_counts(monkeypatch):
    """The decode pieces of an agreed bucket (every rank the same rows): the MoE exchange leaves out the
    all-gather of each rank's row count, whose answer the pass reads back to the host (which a CUDA
    graph cannot), and gives what the exchange with the counts gives."""
    from types import SimpleNamespace
    from sparsekv.parallel import comm
    fake = _TwoRanksAlike()
    monkeypatch.setattr(comm, "dist", SimpleNamespace(all_gather_single=fake.all_gather_single,
                                                      reduce_scatter_single=fake.reduce_scatter_single))
    moe = comm.ExpertParallelDP(None, 2, 1)
    ffn = SimpleNamespace(routed=lambda everyone, mine: everyone * 3, shared=lambda x: x + 1)
    x = torch.randn(4, 8)
    counted = moe.ffn(ffn, x)
    assert fake.gathered == [1, 32]  # the count, then the rows
    fake.gathered.clear()
    moe.uniform_rows = True
    assert torch.equal(moe.ffn(ffn, x), counted) and fake.gathered == [32]
    assert torch.equal(counted, (3 * x + 3 * x) + (x + 1))  # both ranks' expert outputs for its rows, its shared
