"""A decode step is graph-ready outside its selections (docs/exactness.md, "Graph-ready pieces"): the
model's ops between one layer's token selection and the next have shapes that depend only on the
number of rows (and k), never on the requests' context lengths, and none of them reads a value back
to the host or sizes its output from data. Those pieces are what a CUDA graph per batch size captures;
the selections (indexer scoring over each request's history, top-k, the slot table of the picks) and
the tiered cache's working-set resolution run between them as plain ops."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sparsekv import LLM, SamplingParams
from sparsekv.tools.op_count import fill_decoding

# Ops that read a value back to the host or size their output from the data: a CUDA graph cannot hold
# them (capture fails, or replays the sizes of the capture).
SYNCHRONISING = {"_local_scalar_dense", "item", "nonzero", "argwhere", "masked_select", "bincount", "unique",
                 "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "equal",
                 "is_nonzero", "_assert_async", "histc"}


class PieceRecorder(TorchDispatchMode):
    """Each op's (name, output shapes) while `recording` and outside every `eager()` block, and every
    synchronising op there (a boolean index counts: it is a nonzero inside)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.synchronising: list[str] = []
        self.recording, self.eager_depth = False, 0
        self.pieces: list[str] = []  # the recorded calls, in order

    @contextmanager
    def eager(self):
        self.eager_depth += 1
        try:
            yield
        finally:
            self.eager_depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording and not self.eager_depth:
            name = func.overloadpacket.__name__
            tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.ops.append((name, tuple(tuple(t.shape) for t in tensors)))
            bool_index = name in ("index", "index_put", "index_put_") and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args)[0][1:])
            if name in SYNCHRONISING or bool_index:
                self.synchronising.append(name)
        return out


def record_decode_step(path, lengths: list[int], monkeypatch, **options) -> PieceRecorder:
    """The graph pieces of one plain decode step of requests with prompts of `lengths` tokens (all past
    top-k), each having decoded one token already."""
    from sparsekv.cache import pool
    from sparsekv.cache.tiers import TieredKVPool
    from sparsekv.model.attention import MLAttention
    from sparsekv.model.decode_plan import DecodePlan, _SlotTable
    from sparsekv.model.model import DSAModel
    from sparsekv.speculative import MTPDrafter
    options = dict(dict(max_num_seqs=len(lengths), kv_page_size=16, enable_prefix_caching=False, max_model_len=256,
                        max_num_batched_tokens=4096), **options)
    llm = LLM(path, **options)
    prompts = [[(7 * i + 13 * j) % 250 + 1 for i in range(n)] for j, n in enumerate(lengths)]
    fill_decoding(llm.engine, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.engine.step()
    recorder = PieceRecorder()

    def wrap(cls, name: str, piece: bool):
        real = getattr(cls, name)

        def run(*args, **kwargs):
            if not piece:
                with recorder.eager():
                    return real(*args, **kwargs)
            if not recorder.eager_depth:
                recorder.pieces.append(name)
            before, recorder.recording = recorder.recording, True
            try:
                return real(*args, **kwargs)
            finally:
                recorder.recording = before
        monkeypatch.setattr(cls, name, run)
    real_context = llm.engine.executor.runner.build_context
    monkeypatch.setattr(llm.engine.executor.runner, "build_context",
                        lambda chunks: recorder.pieces.append(sum(ch.num_new_tokens for ch in chunks)) or real_context(chunks))
    wrap(DSAModel, "hidden_states", piece=True)
    wrap(DSAModel, "logits", piece=True)
    wrap(MTPDrafter, "step", piece=True)
    for cls, name in ((MLAttention, "_select_decodes"), (DecodePlan, "history"), (_SlotTable, "slots"),
                      (pool, "padded_slots"), (TieredKVPool, "gather_decode_latents"),
                      (TieredKVPool, "dense_decode_latents"), (MTPDrafter, "extend")):
        wrap(cls, name, piece=False)
    with recorder:
        llm.engine.step()
    monkeypatch.undo()
    llm.engine.check_integrity()
    return recorder


def assert_same_pieces(short: PieceRecorder, long: PieceRecorder) -> None:
    assert len(short.ops) > 100  # the pieces were recorded: projections, attention, MoE, logits
    assert short.synchronising == [] and long.synchronising == []
    assert len(short.ops) == len(long.ops)
    differ = [(i, a, b) for i, (a, b) in enumerate(zip(short.ops, long.ops)) if a != b]
    assert differ == [], differ[:5]


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["untiered", "tiered"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_decode_pieces_depend_only_on_the_rows(family, options, glm_ckpt, ds_ckpt, monkeypatch):
    """Two batches of four decodes, one with contexts of 24-33 tokens and one of 60-117 (top-k 8): the
    same ops with the same shapes between the selections, and none of them synchronising."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    assert_same_pieces(record_decode_step(path, [24, 27, 30, 33], monkeypatch, **options),
                       record_decode_step(path, [60, 71, 90, 117], monkeypatch, **options))


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["untiered", "tiered"])
def test_dense_regime_pieces_depend_only_on_the_rows(options, glm_ckpt, monkeypatch):
    """Decodes below top-k (8) attend every entry of their history padded to a power of two, at most
    k: contexts of 4-7 and of 5-8 tokens give the same pieces."""
    assert_same_pieces(record_decode_step(glm_ckpt[0], [2, 3, 4, 5], monkeypatch, **options),
                       record_decode_step(glm_ckpt[0], [3, 4, 5, 6], monkeypatch, **options))


def test_verification_and_draft_step_pieces_depend_only_on_the_rows(monkeypatch):
    """With MTP drafting (K = 2, the bundled model, top-k 256): the target's verification rows and the
    draft step, for contexts of 300-390 and of 600-1,000 tokens. The extend pass is left out: its rows
    are each request's accepted drafts + 1, a row count that the acceptance sets, not the context."""
    from sparsekv.paths import default_model_path
    options = dict(num_speculative_tokens=2, max_model_len=1100)
    short = record_decode_step(default_model_path(), [300, 330, 360, 390], monkeypatch, **options)
    long = record_decode_step(default_model_path(), [600, 700, 900, 1000], monkeypatch, **options)
    assert short.pieces == [12, "hidden_states", "logits", "step", "logits"]  # 4 x (1 + 2 drafts) rows verified
    assert_same_pieces(short, long)


def test_the_recorder_sees_a_synchronising_op():
    """The recorder's check can fail: an op sizing its output from data, and a boolean index, are seen."""
    recorder = PieceRecorder()
    recorder.recording = True
    with recorder:
        x = torch.arange(6)
        x.bincount()
        x[x > 2]
        with recorder.eager():
            x.nonzero()
    assert recorder.synchronising == ["bincount", "index"]


def _decode_step_forward(llm: LLM):
    """The engine's next step (a decode step) as a closure over its context: the model's logits of
    its rows. Calling it again writes the same cache entries again."""
    engine = llm.engine
    runner = engine.executor.runner
    ctx = runner.build_context(engine.scheduler.schedule().chunks)
    return lambda: runner.model.logits(runner.model.hidden_states(ctx, runner.cache))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
def test_a_dense_regime_decode_step_captures_as_one_cuda_graph_on_cuda(glm_ckpt):
    """On CUDA: decodes below top-k select nothing, so their whole forward is one piece. It captures
    (a synchronising op fails the capture) and the replay's logits are the eager ones bit for bit."""
    llm = LLM(glm_ckpt[0], device="cuda", max_num_seqs=4, kv_page_size=16, enable_prefix_caching=False,
              max_model_len=256)
    prompts = [[(7 * i + 13 * j) % 250 + 1 for i in range(n)] for j, n in enumerate((2, 3, 4, 5))]
    fill_decoding(llm.engine, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    forward = _decode_step_forward(llm)
    eager = forward()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
