"""Plain decode steps as fixed-shape pieces per batch-size bucket (model/decode_graphs.py): what a CUDA
graph per piece captures and replays. On a CPU the pieces run uncaptured (`decode_graphs="eager"`):
the same static buffers, padded buckets and selections between pieces as the replay, checked against
the engine's own decode path; the capture itself is checked on CUDA (scripts/gpu_check.py --tiers)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sparsekv import LLM, SamplingParams
from sparsekv.config import ConfigError, EngineConfig
from sparsekv.model.attention import MLAttention
from sparsekv.model.decode_graphs import BucketPieces, DraftPieces, ExtendPieces, bucket_of, buckets
from test_decode_shapes import SYNCHRONISING
from tolerances import assert_same_greedy, logprob_tolerance

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
# Top-k is 8: 3 and 6 start below it (dense regime, then crossing it while decoding), the others above
# (97 is 12x top-k); prompts of one chunk each, so every step after the first is a plain decode step.
LENGTHS = (3, 6, 11, 40, 97)
OPTIONS = dict(kv_page_size=16, max_num_seqs=5, enable_prefix_caching=False, max_model_len=256)


def prompts(lengths=LENGTHS) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 1 for i in range(n)] for j, n in enumerate(lengths)]


def record_selections(monkeypatch) -> list:
    """Each full layer's decode selections, by request, in call order."""
    trace, real = [], MLAttention._decode_selection

    def spy(self, plan, q, index_q, ctx, cache):
        out = real(self, plan, q, index_q, ctx, cache)
        if self.selector is not None and not ctx.draft_step:  # a draft step selects nothing (MTP index reuse)
            trace.append((self.layer_idx, {s.request_id: part.clone() for s, part in zip(plan.sparse, out.split(plan.sizes))}))
        return out
    monkeypatch.setattr(MLAttention, "_decode_selection", spy)
    return trace


def generate(path, mode: str, monkeypatch, lengths=LENGTHS, **options):
    """(outputs, selections, llm): requests of `lengths` with 12, 10, 8, ... new tokens each, so that
    the batch shrinks through the buckets as they finish."""
    with monkeypatch.context() as patch:
        trace = record_selections(patch)
        llm = LLM(path, decode_graphs=mode, **dict(OPTIONS, **options))
        params = [SamplingParams(max_tokens=12 - 2 * i, temperature=0.0, logprobs=3, ignore_eos=True)
                  for i in range(len(lengths))]
        outs = llm.generate(prompts(lengths), params)
        llm.engine.check_integrity()
    return outs, trace, llm


def assert_same_selections(want_trace: list, got_trace: list) -> None:
    assert [layer for layer, _ in got_trace] == [layer for layer, _ in want_trace]
    for (layer, a), (_, b) in zip(want_trace, got_trace):
        assert a.keys() == b.keys()
        for rid in a:
            assert torch.equal(a[rid], b[rid]), (layer, rid)


@pytest.mark.parametrize("selector", ["dsa", "quest"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_decode_pieces_decode_as_the_engine_does(family, selector, glm_ckpt, ds_ckpt, monkeypatch):
    """Requests from below top-k to 12x above it, the batch shrinking from 5 rows (bucket 8) to 1: the
    pieces select exactly what the engine's decode path selects, and give the same greedy tokens with
    logprobs within the tolerance of a computation that rounds differently (their GEMMs run over the
    bucket's padded rows, a dense-regime row attends its history padded to k). FP8 latents are not
    compared here: a latent a rounding apart may be stored a whole e4m3 step away (tolerances.py);
    their pieces are checked for what a replay needs below. Quest (pages of 2 tokens) too: its page
    bounds written inside the pieces, its page scores between them."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    options = dict(selector="quest", quest_page_tokens=2) if selector == "quest" else {}
    want, want_trace, _ = generate(path, "off", monkeypatch, **options)
    got, got_trace, llm = generate(path, "eager", monkeypatch, **options)
    stats = llm.engine.stats()
    assert stats["decode_graph_steps"] == 11 and stats["decode_graph_buckets"] == 0  # none captured on a CPU
    assert set(llm.engine.executor.runner.graphs.buckets) == {8, 4, 2, 1}
    assert_same_selections(want_trace, got_trace)
    assert_same_greedy(want, got, logprob_tolerance(llm))


# A working set of top-k (8) entries per request: the sparse-regime decodes miss at almost every step.
TIERED = dict(kv_tiering=True, device_buffer_tokens=8)
TIER_COUNTS = ("tier_hits", "tier_misses", "h2d_bytes", "d2h_bytes")


def tier_counts(llm) -> dict:
    stats = llm.engine.stats()
    return {key: stats[key] for key in TIER_COUNTS}


@pytest.mark.parametrize("ordering, selector", [("cpu", "dsa"), ("emulated-cuda", "dsa"), ("cpu", "quest")],
                         ids=["cpu", "emulated-cuda", "quest"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_decode_pieces_over_a_tiered_cache_resolve_and_decode_as_the_engine_does(family, ordering, selector, glm_ckpt,
                                                                                  ds_ckpt, monkeypatch, request):
    """Over the tiered cache (a working set of k entries): between the pieces each full layer's picks are
    resolved through the working sets as the engine's decode path resolves them, the pieces read the
    working-set rows and write the new ones, and the new rows reach the host store after the step.
    The same selections, greedy tokens within the logprob tolerance, and the same hits, misses and
    bytes moved each way; with CUDA's copy ordering emulated too (a shared layer's fetched rows land
    only when it waits for them, backups at the next flush); with Quest too."""
    if ordering == "emulated-cuda":
        request.getfixturevalue("emulated_cuda")
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    options = dict(TIERED, **(dict(selector="quest", quest_page_tokens=2) if selector == "quest" else {}))
    want, want_trace, want_llm = generate(path, "off", monkeypatch, **options)
    got, got_trace, llm = generate(path, "eager", monkeypatch, **options)
    stats = llm.engine.stats()
    assert stats["decode_graph_steps"] == 11 and set(llm.engine.executor.runner.graphs.buckets) == {8, 4, 2, 1}
    assert stats["tier_misses"] > 100
    assert tier_counts(llm) == tier_counts(want_llm)
    assert_same_selections(want_trace, got_trace)
    assert_same_greedy(want, got, logprob_tolerance(llm))


# Tiered with K = 3 drafts (two draft steps through the draft piece per chain): a working set must hold
# 4 x top-k (32) entries for the decode pieces to read it.
TIERED_MTP = dict(kv_tiering=True, device_buffer_tokens=32, num_speculative_tokens=3)


# Quest with drafts: pages of 2 tokens, so that a step's rows (3, or 4 with K = 3) share a page or open
# one, and a rejected draft's page is rewound.
QUEST = dict(selector="quest", quest_page_tokens=2)


@pytest.mark.parametrize("cache", ["untiered", "tiered", "tiered-emulated-cuda", "quest", "tiered-quest"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_verification_steps_of_mtp_drafting_decode_as_the_engine_does(family, cache, glm_ckpt, ds_ckpt, tmp_path,
                                                                      monkeypatch, request):
    """With MTP drafting (K = 2): every step verifying drafts (each request its last token and its two
    drafts, a row each, dense-regime rows each masked at its own position) runs as the pieces, and
    each second draft step as the draft piece (its chain's extend-row selections, or within top-k its
    whole history); the extend pass as its two pieces. The same drafts are verified at every step as on the engine's decode
    path, with the same selections, greedy tokens and logprobs within tolerance. Over the tiered
    cache (K = 3; the MTP layer's working sets too, a draft step's picks resolved at every step) the
    same hits, misses and bytes moved, with CUDA's copy ordering emulated too. With Quest each
    verification row's own page bound covers its page's positions up to itself (a fixed-shape window
    in the pieces) and a rejected draft's page is rewound before them: the same selections."""
    from sparsekv.runner import ModelRunner
    from test_batched_decode import with_mtp_layer
    if cache == "tiered-emulated-cuda":
        request.getfixturevalue("emulated_cuda")
    path = with_mtp_layer((glm_ckpt if family == "glm" else ds_ckpt)[0], str(tmp_path / family))
    options = dict(num_speculative_tokens=2) if cache in ("untiered", "quest") else dict(TIERED_MTP)
    if "quest" in cache:
        options.update(QUEST)
    runs = []
    for mode in ("off", "eager"):
        steps, real = [], ModelRunner.build_context
        with monkeypatch.context() as patch:
            patch.setattr(ModelRunner, "build_context",
                          lambda self, chunks: steps.append([list(ch.token_ids) for ch in chunks]) or real(self, chunks))
            outs, trace, llm = generate(path, mode, monkeypatch, **options)
        runs.append((outs, trace, steps, llm))
    (want, want_trace, want_steps, want_llm), (got, got_trace, got_steps, llm) = runs
    if cache.startswith("tiered"):
        assert llm.engine.stats()["tier_misses"] > 100 and tier_counts(llm) == tier_counts(want_llm)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["decode_graph_steps"] >= 8
    assert stats["decode_graph_draft_steps"] >= 8  # draft step 2 of each step that drafted
    assert stats["decode_graph_extend_steps"] >= 8  # every extend pass but the one after the prompts
    assert got_steps == want_steps  # the same drafts verified
    assert [layer for layer, _ in got_trace] == [layer for layer, _ in want_trace]
    assert_same_selections(want_trace, got_trace)
    assert_same_greedy(want, got, logprob_tolerance(llm))


def test_steps_that_are_not_plain_decodes_take_the_engine_s_path(glm_ckpt):
    """Prefill chunks (a step of several tokens of one request), and a step past cuda_graph_max_bs,
    run the engine's path; the others the pieces."""
    llm = LLM(glm_ckpt[0], decode_graphs="eager", cuda_graph_max_bs=2, **OPTIONS)
    graphs = llm.engine.executor.runner.graphs
    llm.generate(prompts((3, 11, 40)), GREEDY)  # every decode step has 3 rows
    assert graphs.steps == 0
    llm.generate(prompts((3, 11)), GREEDY)
    assert graphs.steps == 11 and set(graphs.buckets) == {2}
    llm.engine.check_integrity()


class PieceReads(TorchDispatchMode):
    """What the pieces read that a CUDA graph could not replay: a tensor some eager op of the step made
    (the selections, the step's context), other than the bucket's static inputs, which the eager ops
    write in place before each replay; an op that reads a value back to the host; a tensor made from
    host data inside a piece (on CUDA a copy from pageable memory, which a capture refuses)."""

    def __init__(self, static: list[torch.Tensor]):
        super().__init__()
        self.static = {t.untyped_storage().data_ptr() for t in static}
        self.eager_made: set[int] = set()
        self.in_piece = False
        self.stale, self.synchronising, self.from_host = [], [], []
        self.piece_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not self.in_piece:  # fresh memory only: a view or an in-place write keeps its input's
            fresh = {t.untyped_storage().data_ptr() for t in outputs} - {t.untyped_storage().data_ptr() for t in inputs}
            self.eager_made |= fresh - self.static
            return out
        self.piece_ops += 1
        self.stale += [name for t in inputs if t.untyped_storage().data_ptr() in self.eager_made]
        self.eager_made -= {t.untyped_storage().data_ptr() for t in outputs}  # memory an eager tensor had, reused
        if name in SYNCHRONISING or (name in ("index", "index_put", "index_put_")
                                     and any(t.dtype == torch.bool for t in inputs[1:])):
            self.synchronising.append(name)
        if name in ("lift_fresh", "lift_fresh_copy", "scalar_tensor"):
            self.from_host.append(name)
        return out


@pytest.mark.parametrize("options", [{}, dict(kv_cache_dtype="fp8"), dict(num_speculative_tokens=2), TIERED,
                                     dict(TIERED, kv_cache_dtype="fp8"), dict(selector="quest", quest_page_tokens=2),
                                     dict(TIERED, selector="quest", quest_page_tokens=2), TIERED_MTP,
                                     dict(QUEST, num_speculative_tokens=2)],
                         ids=["dsa", "fp8", "mtp", "tiered", "tiered-fp8", "quest", "tiered-quest", "tiered-mtp",
                              "quest-mtp"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_pieces_read_only_their_static_inputs_the_model_and_the_cache(family, options, glm_ckpt, ds_ckpt, tmp_path,
                                                                      monkeypatch):
    """Three decode steps through the same buckets (3 requests padded to 4, from below top-k to above
    it; with MTP drafting the verification, extend and draft pieces too), every op of each step
    watched (both families, plain and FP8 latents): inside the pieces none reads a tensor an eager op of
    the step made (only the static inputs, which the eager ops fill in place, the weights, the cache
    and the pieces' own outputs), none synchronises and none makes a tensor from host data: a replay of
    the captured pieces computes what running them computes. Breaking it (a piece reading the step's
    own positions; with Quest, its page bounds reset by a boolean index, which synchronises, to a
    scalar made on the host) is seen."""
    from test_batched_decode import with_mtp_layer
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    if "num_speculative_tokens" in options:
        path = with_mtp_layer(path, str(tmp_path / family))
    llm = LLM(path, decode_graphs="eager", **OPTIONS, **options)
    engine = llm.engine
    runner = engine.executor.runner
    for i, prompt in enumerate(prompts((3, 11, 40))):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # the prefills
    engine.step()  # the buckets' static inputs made (outside the watched steps)
    watch = PieceReads([])

    def in_piece(piece):
        def run():
            watch.in_piece = True
            try:
                piece()
            finally:
                watch.in_piece = False
        return run
    for cls in (BucketPieces, DraftPieces, ExtendPieces):
        monkeypatch.setattr(cls, "pieces", lambda self, real=cls.pieces: [in_piece(p) for p in real(self)])
    steps = []

    def registered(build):  # a context the runner builds from host data: the step's own tensors
        def run(self, *args):
            ctx = build(self, *args)
            made = [ctx.input_ids, ctx.positions, ctx.slot_mapping, ctx.logits_rows, *(seq.slots for seq in ctx.seqs)]
            watch.eager_made |= {t.untyped_storage().data_ptr() for t in made}
            steps.append(ctx)
            return ctx
        return run
    for name in ("build_context", "build_mtp_context", "build_draft_step_context"):
        monkeypatch.setattr(type(runner), name, registered(getattr(type(runner), name)))
    before = dict(engine.stats())
    for _ in range(3):
        with watch:
            engine.step()
        assert watch.piece_ops > 100 and watch.stale == [] and watch.synchronising == [] and watch.from_host == []
    stats = engine.stats()
    drafts = options.get("num_speculative_tokens", 0)  # each step's draft steps 2..K run the draft piece
    runs = {"steps": 3} | ({"extend_steps": 3, "draft_steps": 3 * (drafts - 1)} if drafts else {})
    assert {kind: stats[f"decode_graph_{kind}"] - before[f"decode_graph_{kind}"] for kind in runs} == runs
    # the check can fail: a piece reading the step's own positions (made by the eager runner)
    real_first = BucketPieces._first
    monkeypatch.setattr(BucketPieces, "_first", lambda self: (real_first(self), steps[-1].positions.sum()))
    with watch:
        engine.step()
    assert "sum" in watch.stale
    if options.get("selector") == "quest":  # the page bounds' reset as a boolean index
        from sparsekv.model.selectors import QuestSelector

        def reset_by_mask(self, page, slots, lo, hi):
            fresh = page[slots % self.page_tokens == 0]
            lo[fresh], hi[fresh] = float("inf"), float("-inf")
        monkeypatch.setattr(QuestSelector, "_reset_opened", reset_by_mask)
        with watch:
            engine.step()
        assert "index" in watch.synchronising and "lift_fresh" in watch.from_host


def test_buckets():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64] and buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_of(n, 48) for n in (1, 3, 33, 48, 49)] == [1, 4, 48, 48, None]


def test_decode_graphs_options_are_checked(glm_ckpt, tmp_path, caplog):
    from test_batched_decode import with_mtp_layer
    mtp = with_mtp_layer(glm_ckpt[0], str(tmp_path / "mtp"))
    with pytest.raises(ConfigError, match="decode_graphs"):
        EngineConfig(model=glm_ckpt[0], decode_graphs="on").validate()
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        EngineConfig(model=glm_ckpt[0], cuda_graph_max_bs=0).validate()
    EngineConfig(model=glm_ckpt[0], decode_graphs="eager", kv_tiering=True).validate()
    # tiered with drafts: a working set must hold a decode's (1 + K) x k picks (k = 8; the default is 2k)
    with pytest.raises(ConfigError, match="a working set of 16 entries, .* raise device_buffer_tokens to 24"):
        LLM(mtp, decode_graphs="eager", kv_tiering=True, num_speculative_tokens=2, **OPTIONS)
    llm = LLM(mtp, decode_graphs="eager", kv_tiering=True, num_speculative_tokens=2, device_buffer_tokens=24,
              **OPTIONS)
    assert llm.engine.executor.runner.graphs is not None
    from dataclasses import replace
    from sparsekv.executor import InProcessExecutor
    small = LLM(mtp, kv_tiering=True, num_speculative_tokens=2, **OPTIONS).engine.executor.pool
    with caplog.at_level("WARNING", logger="sparsekv.executor"):  # auto (on CUDA): the engine's path, said
        assert not InProcessExecutor._decode_pieces_read(small, replace(llm.engine.config, decode_graphs="auto"))
    assert "raise device_buffer_tokens to 24" in caplog.text
    with pytest.raises(ConfigError, match="attention 'dense'"):
        EngineConfig(model=glm_ckpt[0], decode_graphs="eager", attention="dense").validate()
    EngineConfig(model=glm_ckpt[0], decode_graphs="eager", selector="quest", num_speculative_tokens=1).validate()
    EngineConfig(model=glm_ckpt[0], decode_graphs="eager", selector="quest", kv_tiering=True).validate()
    EngineConfig(model=glm_ckpt[0], decode_graphs="eager", data_parallel_size=2, enable_expert_parallel=True,
                 num_speculative_tokens=1).validate()
    # auto: CUDA graphs on CUDA where built, else the engine's path (no padding page either)
    assert EngineConfig(model=glm_ckpt[0]).decode_graph_mode() == "off"
    assert EngineConfig(model=glm_ckpt[0], device="cuda", tensor_parallel_size=2).decode_graph_mode() == "capture"
    assert EngineConfig(model=glm_ckpt[0], device="cuda").decode_graph_mode() == "capture"
    assert EngineConfig(model=glm_ckpt[0], device="cuda", kv_tiering=True).decode_graph_mode() == "capture"
    assert EngineConfig(model=glm_ckpt[0], device="cuda", kv_tiering=True,
                        num_speculative_tokens=1).decode_graph_mode() == "capture"  # the pool decides (above)
    assert EngineConfig(model=glm_ckpt[0], device="cuda", decode_graphs="off").decode_graph_mode() == "off"
    llm = LLM(glm_ckpt[0], **OPTIONS)
    assert llm.engine.executor.runner.graphs is None and llm.engine.kv.pool.padding_slot is None
    llm = LLM(glm_ckpt[0], kv_tiering=True, **OPTIONS)
    assert llm.engine.executor.runner.graphs is None and llm.engine.kv.pool.padding_row is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
@pytest.mark.parametrize("drafts, tiered, quest", [(0, False, False), (2, False, False), (0, True, False),
                                                   (2, False, True)], ids=["plain", "mtp", "tiered", "mtp-quest"])
def test_decode_steps_replay_from_cuda_graphs_on_cuda_as_the_engine_decodes(drafts, tiered, quest, glm_ckpt, tmp_path,
                                                                            monkeypatch):
    """On CUDA, float32: every bucket captured at its first step (its replay checked against that
    step's eager run bit for bit: no bucket falls back), and the outputs the engine's decode path gives:
    the same selections and greedy tokens, logprobs within tolerance; with MTP drafting (K = 2), the
    verification steps so, and the same drafts verified; over the tiered cache, the same hits, misses
    and bytes moved; with Quest and drafts, its page bounds rewound before the replays."""
    from test_batched_decode import with_mtp_layer
    path = with_mtp_layer(glm_ckpt[0], str(tmp_path / "mtp")) if drafts else glm_ckpt[0]
    options = dict(device="cuda", dtype="float32", num_speculative_tokens=drafts, **(TIERED if tiered else {}),
                   **(QUEST if quest else {}))
    want, want_trace, want_llm = generate(path, "off", monkeypatch, **options)
    got, got_trace, llm = generate(path, "auto", monkeypatch, **options)
    stats = llm.engine.stats()
    assert stats["decode_graph_steps"] >= 8 and stats["decode_graph_eager_buckets"] == 0
    assert stats["decode_graph_buckets"] >= 3
    if tiered:
        assert tier_counts(llm) == tier_counts(want_llm)
    assert len(got_trace) == len(want_trace)
    for (_, a), (_, b) in zip(want_trace, got_trace):
        assert all(torch.equal(a[rid], b[rid]) for rid in a)
    assert_same_greedy(want, got, logprob_tolerance(llm))


def test_a_step_s_ops_split_by_the_pieces_they_run_in(glm_ckpt):
    """`sparsekv bench batch`'s launches with graphs: of a plain decode step's ops, those inside the
    pieces replay as one graph per piece (layer 0 and every other full layer start one, and the last
    ends the step), so the step launches the ops outside them plus one per piece."""
    from sparsekv.tools.op_count import decode_graph_step_ops
    llm = LLM(glm_ckpt[0], decode_graphs="eager", **OPTIONS)
    for i, prompt in enumerate(prompts((3, 11, 40))):
        llm.engine.add_request(f"r{i}", prompt, GREEDY)
    llm.engine.step()
    split = decode_graph_step_ops(llm.engine)
    assert split.pieces == len(llm.engine.model_config.full_layers) + 1 and llm.engine.stats()["decode_graph_steps"] == 1
    assert 100 < split.inside < split.total and split.launches == split.total - split.inside + split.pieces


OUTPUTS = ("h", "x", "q", "index_q", "final", "logits")  # what a piece leaves on its pieces' object


def _tensors(value) -> list:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class FakeCudaGraphs:
    """torch.cuda's graph API as decode_graphs.py calls it, on a CPU: a capture records the piece (and
    runs it, where CUDA would only record its kernels) and the output tensors it leaves; a replay runs
    it again and writes the new values into those same tensors, leaving the pieces' attributes as the
    capture left them (a replay runs no Python): a selection reading a tensor a later capture replaced
    reads stale values, as it would on a GPU. `corrupt`: replays add 1 to the logits (a replay that
    reads stale inputs); `refuse`: the capture raises as CUDA does for an op it cannot capture."""

    def __init__(self, monkeypatch, corrupt: bool = False, refuse: bool = False):
        import contextlib
        self.corrupt, self.refuse, self.captures, self.replays = corrupt, refuse, 0, 0
        fakes = self

        class Graph:
            def replay(self):
                fakes.replays += 1
                names = [name for name in OUTPUTS if hasattr(self.owner, name)]
                kept = {name: _copy_of(getattr(self.owner, name)) for name in names}
                self.piece()
                for name in names:  # the new values into the captured tensors; the attributes as captured
                    for old, new in zip(_tensors(self.captured[name]), _tensors(getattr(self.owner, name))):
                        if old is not new:
                            old.copy_(new)
                    setattr(self.owner, name, kept[name])
                if fakes.corrupt and self.last:
                    self.owner.logits += 1

        @contextlib.contextmanager
        def graph(g, pool=None, capture_error_mode="global"):
            assert pool == "pool" and capture_error_mode == "thread_local"
            fakes.captures += 1
            if fakes.refuse:
                raise RuntimeError("operation not permitted when stream is capturing")
            fakes.capturing = g
            yield

        stream = SimpleNamespace(wait_stream=lambda other: None)
        monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        def pieces(owner):
            def recorded(piece, last):
                def run():
                    g = getattr(fakes, "capturing", None)
                    if g is not None:  # inside a capture: the graph keeps the piece and what it leaves
                        g.piece, g.last, g.owner, fakes.capturing = piece, last, owner, None
                    piece()
                    if g is not None:
                        g.captured = {name: _copy_of(getattr(owner, name)) for name in OUTPUTS if hasattr(owner, name)}
                return run
            parts = real[type(owner)](owner)
            return [recorded(p, i == len(parts) - 1) for i, p in enumerate(parts)]
        real = {cls: cls.pieces for cls in (BucketPieces, DraftPieces, ExtendPieces)}
        for cls in real:
            monkeypatch.setattr(cls, "pieces", pieces)



def _copy_of(value):
    """The attribute's value with its containers copied (the tensors themselves shared)."""
    return dict(value) if isinstance(value, dict) else value


def captured_engine(path, monkeypatch, drafts: int = 0, options: dict = {}, **fakes):
    """An engine whose decode graphs capture (with `FakeCudaGraphs`) on a CPU."""
    from sparsekv.model.decode_graphs import DecodeGraphs
    llm = LLM(path, decode_graphs="eager", num_speculative_tokens=drafts, **OPTIONS, **options)
    runner = llm.engine.executor.runner
    runner.graphs = DecodeGraphs(runner, 64, capture=True)
    return llm, FakeCudaGraphs(monkeypatch, **fakes)


def test_each_bucket_is_captured_at_its_first_step_and_replayed_after(glm_ckpt, monkeypatch):
    """The capture's control flow, on a fake of torch.cuda's graph API: a bucket's first step runs eagerly
    (its result is the step's), then each piece is captured and the step replayed and compared; later
    steps of that bucket only replay. The outputs are the engine's decode path's."""
    want = LLM(glm_ckpt[0], decode_graphs="off", **OPTIONS).generate(prompts(), GREEDY)
    llm, fakes = captured_engine(glm_ckpt[0], monkeypatch)
    got = llm.generate(prompts(), GREEDY)
    stats = llm.engine.stats()
    assert (stats["decode_graph_steps"], stats["decode_graph_buckets"], stats["decode_graph_eager_buckets"]) == (11, 1, 0)
    pieces = len(llm.engine.model_config.full_layers) + 1
    assert fakes.captures == pieces and fakes.replays == 11 * pieces  # the first step's check, then 10 replays
    assert_same_greedy(want, got, logprob_tolerance(llm))
    llm.update_weights_from_disk(glm_ckpt[0])  # a weight update forgets the captured buckets
    assert llm.engine.stats()["decode_graph_buckets"] == 0
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == [o.token_ids for o in want]
    assert llm.engine.stats()["decode_graph_buckets"] == 1  # captured again, with the new weights


@pytest.mark.parametrize("fault", ["corrupt", "refuse"])
def test_a_bucket_whose_replay_differs_or_whose_capture_fails_stays_eager(fault, glm_ckpt, monkeypatch):
    """A replay that differs from the bucket's first eager step (or a capture CUDA refuses) leaves the
    bucket eager, counted; the step's outputs are the eager run's, and so are the later steps'."""
    want = LLM(glm_ckpt[0], decode_graphs="off", **OPTIONS).generate(prompts(), GREEDY)
    llm, fakes = captured_engine(glm_ckpt[0], monkeypatch, **{fault: True})
    got = llm.generate(prompts(), GREEDY)
    stats = llm.engine.stats()
    assert (stats["decode_graph_steps"], stats["decode_graph_buckets"], stats["decode_graph_eager_buckets"]) == (11, 0, 1)
    assert fakes.captures == (len(llm.engine.model_config.full_layers) + 1 if fault == "corrupt" else 1)
    assert_same_greedy(want, got, logprob_tolerance(llm))


@pytest.mark.parametrize("fault", ["none", "corrupt", "refuse"])
def test_a_tiered_bucket_s_first_step_is_resolved_once_however_often_its_capture_runs_it(fault, glm_ckpt,
                                                                                          monkeypatch):
    """Over the tiered cache a bucket's first step runs two or three times in its capture (eagerly, then
    replayed for the check, and eagerly again if the replay differs or the capture fails): its picks are
    resolved once, in the first run, and the runs after restore them, so the working sets hold what
    the engine's decode path leaves and every hit, miss and byte moved is counted once."""
    want = LLM(glm_ckpt[0], decode_graphs="off", **OPTIONS, **TIERED)
    want_out = want.generate(prompts(), GREEDY)
    llm, fakes = captured_engine(glm_ckpt[0], monkeypatch, options=TIERED, **({} if fault == "none" else {fault: True}))
    got = llm.generate(prompts(), GREEDY)
    stats = llm.engine.stats()
    assert (stats["decode_graph_buckets"], stats["decode_graph_eager_buckets"]) == ((1, 0) if fault == "none" else (0, 1))
    assert fakes.captures > 0 and tier_counts(llm) == tier_counts(want)
    assert_same_greedy(want_out, got, logprob_tolerance(llm))
    llm.engine.check_integrity()


@pytest.mark.parametrize("cache", ["untiered", "tiered", "quest"])
def test_draft_steps_are_captured_per_bucket_and_replayed_chain_after_chain(cache, glm_ckpt, tmp_path, monkeypatch):
    """With MTP drafting (K = 3) on the fake graph API: the draft piece captured at its bucket's first
    draft step and replayed after, each chain's picks loaded into its static slot table once (over
    the tiered cache resolved at every step, each capture's first step once), and the extend pieces
    per bucket of rows; the drafts, so the steps and outputs, those of the engine's own MTP passes,
    and the tiered cache's hits, misses and bytes moved. With Quest, a capture's step run again starts
    from its page bounds rewound again."""
    from test_batched_decode import with_mtp_layer
    path = with_mtp_layer(glm_ckpt[0], str(tmp_path / "mtp"))
    options = {"untiered": {}, "quest": QUEST,
               "tiered": {k: v for k, v in TIERED_MTP.items() if k != "num_speculative_tokens"}}[cache]
    want = LLM(path, decode_graphs="off", num_speculative_tokens=3, **OPTIONS, **options)
    want_out = want.generate(prompts(), GREEDY)
    llm, fakes = captured_engine(path, monkeypatch, drafts=3, options=options)
    got = llm.generate(prompts(), GREEDY)
    if cache == "tiered":
        assert tier_counts(llm) == tier_counts(want)
    stats, spec = llm.engine.stats(), want.engine.stats()
    graphs = llm.engine.executor.runner.graphs
    assert stats["decode_graph_eager_buckets"] == 0 and stats["decode_graph_draft_steps"] > 0
    assert stats["decode_graph_extend_steps"] > 0
    assert stats["decode_graph_buckets"] == len(graphs.buckets) + len(graphs.drafts) + len(graphs.extends)
    assert (stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]) == \
        (spec["spec_decode_num_draft_tokens"], spec["spec_decode_num_accepted_tokens"])
    assert_same_greedy(want_out, got, logprob_tolerance(llm))
