"""`sparsekv train` on a tiny preset: every stage runs and its loss falls; exact resume; the exported
directory loads in transformers and in sparsekv with matching logits (sparse regime)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from sparsekv.train.cli import main as train_main
from sparsekv.train.trainer import STATE_FILE
from tolerances import logit_tolerance

torch.set_num_threads(1)

STEPS = "40,16,24,16"
COMMON = ["--preset", "test", "--seq-len", "96", "--batch-size", "4", "--vocab-size", "400", "--max-files", "30",
          "--heldout-rows", "4", "--log-every", "1", "--quiet", "--steps", STEPS]


def _train(tmp, name, *extra):
    out, work = os.path.join(tmp, name), os.path.join(tmp, name + ".work")
    assert train_main(COMMON + ["--out", out, "--work-dir", work, *extra]) == 0
    return out, work


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(str(tmp_path_factory.mktemp("train")), "tiny")


def _history(work):
    return torch.load(os.path.join(work, STATE_FILE), weights_only=False)["state"]["history"]


def _first_last(history, stage, key, n=4):
    vals = [h[key] for h in history if h["stage"] == stage]
    return sum(vals[:n]) / n, sum(vals[-n:]) / n


@pytest.mark.parametrize("stage,key", [("pretrain", "lm"), ("warmup", "kl"), ("sparse", "lm"), ("mtp", "mtp_ce")])
def test_every_stage_runs_and_its_loss_falls(trained, stage, key):
    first, last = _first_last(_history(trained[1]), stage, key)
    assert last < first, f"{stage} {key}: {first:.4f} -> {last:.4f}"


def test_sparse_stage_trains_the_indexer_on_the_selected_set(trained):
    """Every sparse step is logged, and its KL is the indexer's loss over each query's selected keys
    (top-k), not over every visible key, which on the same traces is far larger."""
    from sparsekv.tools.eval_common import load_parts
    from sparsekv.train.data import Batch
    from sparsekv.train.stages import indexer_loss, stage_loss
    hist = [h for h in _history(trained[1]) if h["stage"] == "sparse"]
    assert len(hist) == int(STEPS.split(",")[2])
    cfg, tensors = load_parts(trained[0])
    model = _training_model(cfg, tensors)
    ids = torch.randint(0, cfg.vocab_size, (2, 97), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.arange(96).expand(2, 96), torch.ones(2, 96))
    with torch.no_grad():
        logged = stage_loss(model, "sparse", batch, 0.0)[1]["kl"]
        traces = model(ids[:, :-1], batch.positions, sparse=True, want_index=True, want_probs=True).traces
    on_selection = indexer_loss(traces, cfg.indexer_types, sparse=True).item()
    on_every_key = indexer_loss(traces, cfg.indexer_types, sparse=False).item()
    # the same forward on the same batch as stage_loss's: the same bits
    assert logged == on_selection and on_every_key > 100 * on_selection


def test_export_layout(trained):
    out, _ = trained
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["num_nextn_predict_layers"] == 1
    assert cfg["indexer_types"] == ["full", "shared", "full", "shared"]
    names = set(load_file(os.path.join(out, "model.safetensors")))
    L = cfg["num_hidden_layers"]
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "self_attn.indexer.wk.weight", "mlp.experts.0.gate_proj.weight"):
        assert f"model.layers.{L}.{n}" in names
    assert not any(n.startswith("model.layers.1.self_attn.indexer.") for n in names)   # shared layer
    aux = set(load_file(os.path.join(out, "indexshare", "indexers.safetensors")))
    assert aux and all(n.startswith(("model.layers.1.", "model.layers.3.")) for n in aux)
    for f in ("tokenizer.json", "tokenizer_config.json", "training.json"):
        assert os.path.exists(os.path.join(out, f))


def test_tokenizer_and_chat_template_load_in_transformers(trained):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(trained[0])
    text = "def f(x):\n    return 12345\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi\n<|assistant|>\n"


@pytest.fixture(scope="module")
def grouped_tokenizer():
    from sparsekv.train.data import read_split
    from sparsekv.train.tokenizer import train_tokenizer
    return train_tokenizer(read_split(max_files=30)[0], 400, digit_group=3)


def test_digit_groups_cut_every_number_into_threes_from_the_left(grouped_tokenizer, tmp_path):
    """`--digit-group 3`: 1100 tokens on top of the corpus BPE; every number of 1-13 digits is cut
    into groups of 3 from the left, decodes back exactly, and transformers' tokenizer gives the same ids."""
    import random

    from transformers import PreTrainedTokenizerFast

    from sparsekv.train.tokenizer import digit_group_of
    tok = grouped_tokenizer
    assert digit_group_of(tok) == 3 and tok.get_vocab_size() == 400 + 1100
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    rng = random.Random(0)
    for _ in range(300):
        number = str(rng.randrange(10 ** rng.randint(1, 13)))
        text = f"x = {number}.\n"
        enc = tok.encode(text)
        assert [t for t in enc.tokens if t.isdigit()] == [number[i:i + 3] for i in range(0, len(number), 3)]
        assert tok.decode(enc.ids) == text and hf.encode(text) == enc.ids


def test_repeat_rows_of_a_digit_group_tokenizer_draw_from_every_number_token(grouped_tokenizer):
    from sparsekv.train.data import number_tokens
    ids = number_tokens(grouped_tokenizer)
    texts = [grouped_tokenizer.id_to_token(i) for i in ids]
    assert len(set(ids)) == 1110 and texts[:10] == [str(d) for d in range(10)] and texts[-1] == "999"


def test_a_work_dir_with_another_digit_group_is_refused(trained):
    with pytest.raises(SystemExit, match="--digit-group 3"):
        train_main(COMMON + ["--out", trained[0] + "-dg3", "--work-dir", trained[1], "--digit-group", "3"])


def _first_topk_tie(tm, ids: list[int]) -> int:
    """The first row with a tie at the k-th index score (ReLU zeros), or len(ids). Such ties make the
    top-k set implementation-defined (model-spec §7.2), so parity is only defined on the rows before
    the first one. A near-tie counts too: transformers, sparsekv and the training model group the
    reductions below the scores differently, so their scores are a rounding apart (for layer i, i + 1
    layers of it, relative to the row's largest score: tests/tolerances.py), and a gap within that
    could order the two keys either way."""
    from tolerances import EPS32, LAMBDA, reduction_length
    n, k = len(ids), tm.cfg.index_topk
    per_layer = LAMBDA * reduction_length(tm.cfg) ** 0.5 * EPS32
    with torch.no_grad():
        traces = tm(torch.tensor([ids]), torch.arange(n)[None], sparse=True, want_index=True).traces
    first = n
    for i, t in enumerate(tm.cfg.indexer_types):
        if t == "full":
            for row in range(k, first):
                v = traces[i].index[0, row, :row + 1].topk(k + 1).values
                if v[k - 1] - v[k] <= (i + 1) * per_layer * v.abs().max():
                    first = row
                    break
    return first


def _training_model(cfg, tensors):
    from sparsekv.train.model import GlmDsaForTraining
    tm = GlmDsaForTraining(cfg, aux_indexers=True)
    tm.load_state_dict(tensors, strict=True)
    return tm


def _tie_free_sequence(cfg, tensors, n: int, tie_free_rows: int | None = None) -> tuple[list[int], int]:
    """A random sequence of n tokens whose first `tie_free_rows` (default all) rows have no top-k tie,
    and how many rows are tie-free."""
    tm = _training_model(cfg, tensors)
    for seed in range(50):
        ids = torch.randint(0, cfg.vocab_size - 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        first = _first_topk_tie(tm, ids)
        if first >= (tie_free_rows or n):
            return ids, first
    raise AssertionError("no tie-free sequence in 50 tries")


def test_round_trip_parity_transformers_and_sparsekv(trained):
    """Logits at every position of a sequence 7x longer than index_topk, fp32, within the rounding
    bound of two implementations (tests/tolerances.py)."""
    from transformers import GlmMoeDsaForCausalLM
    from sparsekv.tools.eval_common import build_model, load_parts, sequence_logits
    out, _ = trained
    ref = GlmMoeDsaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg, tensors = load_parts(out)
    model = build_model(cfg, tensors)
    assert model.mtp is not None                  # sparsekv keeps the MTP layer transformers drops
    ids, _ = _tie_free_sequence(cfg, tensors, 56)
    assert len(ids) > 4 * cfg.index_topk
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    ours = sequence_logits(model, ids, "sparse")
    assert (ours - ref_logits).abs().max().item() <= logit_tolerance(model)


def test_round_trip_through_the_llm_api(trained):
    from transformers import GlmMoeDsaForCausalLM
    from sparsekv import LLM, SamplingParams
    from conftest import assert_matches_reference
    from sparsekv.tools.eval_common import load_parts
    out, _ = trained
    ref = GlmMoeDsaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = _tie_free_sequence(*load_parts(out), 46)[0][:40]
    llm = LLM(out, max_model_len=128, prefill_chunk_tokens=16, kv_page_size=8)
    res = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))[0]
    assert_matches_reference(ref, prompt, res)


def test_training_model_matches_the_engine_in_the_sparse_regime(trained):
    from sparsekv.tools.eval_common import build_model, load_parts, sequence_logits
    out, _ = trained
    cfg, tensors = load_parts(out)
    tm = _training_model(cfg, tensors)
    ids = torch.tensor(_tie_free_sequence(cfg, tensors, 48)[0])
    with torch.no_grad():
        ours = tm(ids[None], torch.arange(48)[None], sparse=True).logits[0]
    model = build_model(cfg, tensors)  # the engine's model: other groupings than the training model's
    assert (ours - sequence_logits(model, ids.tolist(), "sparse")).abs().max() <= logit_tolerance(model)


def test_resume_is_exact(trained, tmp_path):
    out_b, work_b = _train(str(tmp_path), "paused", "--stop-after-steps", "50")
    assert not os.path.exists(out_b)                      # paused mid-way (stage 2), nothing exported
    state = torch.load(os.path.join(work_b, STATE_FILE), weights_only=False)["state"]
    assert (state["stage"], state["step"]) == (1, 10)
    _train(str(tmp_path), "paused")                       # same command again continues
    a = load_file(os.path.join(trained[0], "model.safetensors"))
    b = load_file(os.path.join(out_b, "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_output_that_holds_files_or_bad_numbers_are_refused_before_any_work(tmp_path, capsys):
    """--out defaults to the bundled model: writing over a directory that holds files needs --overwrite.
    Sizes, learning rates and intervals out of range are usage errors, checked as parsed."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "config.json").write_text("{}")
    work = str(tmp_path / "w")
    assert train_main(COMMON + ["--out", str(held), "--work-dir", work]) == 2  # (a regression trains briefly)
    assert "--overwrite" in capsys.readouterr().err and not os.path.exists(work)
    (tmp_path / "file").write_text("x")
    assert train_main(COMMON + ["--out", str(tmp_path / "file"), "--work-dir", work]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert train_main(COMMON + ["--out", str(tmp_path / "file" / "sub"), "--work-dir", work]) == 2
    assert "not a writable directory" in capsys.readouterr().err
    for flag, value in (("--lr", "nan"), ("--lr", "0"), ("--batch-size", "0"), ("--seq-len", "1"),
                        ("--checkpoint-every", "0"), ("--heldout-rows", "0"), ("--threads", "0")):
        with pytest.raises(SystemExit) as exit_info:
            train_main([flag, value, "--out", str(tmp_path / "x"), "--work-dir", work])
        assert exit_info.value.code == 2 and flag in capsys.readouterr().err, flag
    assert not os.path.exists(work)


def test_bad_steps_flag_is_an_error(tmp_path, capsys):
    assert train_main(["--steps", "1,2", "--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "w")]) == 2
    assert "--steps" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # flags are checked before anything is written
    assert train_main(["--steps", "1,-2,3,4", "--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "w")]) == 2
    assert "negative" in capsys.readouterr().err
    assert train_main(["--doc-min-frac", "0", "--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "w")]) == 2
    assert "--doc-min-frac" in capsys.readouterr().err


def _source(work, seq_len=400, **kw):
    from sparsekv.train.data import BatchSource
    from sparsekv.train.tokenizer import load_tokenizer
    corpus = torch.load(os.path.join(work, "corpus.pt"))
    return BatchSource(load_tokenizer(work), corpus["train"], seq_len, 6, 0, **kw)


def test_doc_min_frac_moves_the_answers_off_the_row_end(trained):
    src = _source(trained[1], synth_frac=1.0, doc_min_frac=0.5)
    ends = set()
    for step in range(6):
        b = src.batch(0, step)
        assert b.ids.shape == (6, 401) and b.weights.shape == (6, 400)
        for w in b.weights:
            answer = (w > 1).nonzero()
            if len(answer):
                ends.add(answer[-1].item())
    assert len(ends) > 5 and min(ends) < 350          # answers end at many indices, not only at the row end
    again = _source(trained[1], synth_frac=1.0, doc_min_frac=0.5).batch(0, 3)
    assert torch.equal(again.ids, src.batch(0, 3).ids)   # deterministic
    # the default layout is unchanged: the document fills the row and its answers end it
    b = _source(trained[1], synth_frac=1.0).batch(0, 0)
    assert all((w > 1).nonzero()[-1].item() >= 390 for w in b.weights if (w > 1).any())


def test_copy_warmup_batches(trained):
    kw = dict(synth_frac=0.0, copy_warmup_steps=3, copy_warmup_seq_len=200, doc_min_frac=0.6)
    src = _source(trained[1], **kw)
    for step in range(3):
        b = src.batch(0, step)
        assert b.ids.shape == (6, 201) and torch.equal(b.positions, torch.arange(200).expand(6, 200))
        assert sum(bool((w > 1).any()) for w in b.weights) >= 3   # retrieval rows (some may fall back to code)
    assert src.batch(0, 3).ids.shape == (6, 401)                # then the normal rows
    assert src.batch(2, 0).ids.shape == (6, 401)                # only in the pretrain stage
    assert torch.equal(src.batch(0, 1).ids, _source(trained[1], **kw).batch(0, 1).ids)
def test_copy_warmup_run_resumes_exactly_and_records_the_probe(tmp_path):
    extra = ["--copy-warmup-steps", "12", "--copy-warmup-seq-len", "48", "--doc-min-frac", "0.5",
             "--probe-length", "512"]
    out_a, work_a = _train(str(tmp_path), "a", *extra)
    out_b, work_b = _train(str(tmp_path), "b", *extra, "--stop-after-steps", "7")   # pause inside the warm-up
    state = torch.load(os.path.join(work_b, STATE_FILE), weights_only=False)["state"]
    assert (state["stage"], state["step"]) == (0, 7)
    _train(str(tmp_path), "b", *extra)
    a = load_file(os.path.join(out_a, "model.safetensors"))
    b = load_file(os.path.join(out_b, "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    heldout = json.load(open(os.path.join(out_a, "training.json")))["heldout"]
    assert 0.0 <= heldout["pretrain"]["answer_token_acc"] <= 1.0 and "answer_exact" in heldout["mtp"]


def test_copy_warmup_longer_than_pretrain_is_an_error(tmp_path, capsys):
    assert train_main(["--steps", "10,2,2,2", "--copy-warmup-steps", "11", "--out", str(tmp_path / "x"),
                       "--work-dir", str(tmp_path / "w")]) == 2
    assert "--copy-warmup-steps" in capsys.readouterr().err
    assert train_main(["--copy-warmup-repeat-frac", "1.5", "--out", str(tmp_path / "x"),
                       "--work-dir", str(tmp_path / "w")]) == 2
    assert "--copy-warmup-repeat-frac" in capsys.readouterr().err


def test_copy_warmup_repeat_rows_weigh_only_the_predictable_copy(trained):
    src = _source(trained[1], synth_frac=0.0, copy_warmup_steps=2, copy_warmup_seq_len=120, copy_warmup_repeat_frac=1.0)
    digits = set(src.number_tokens)
    b = src.batch(0, 0)
    assert b.ids.shape == (6, 121) and torch.equal(b.positions, torch.arange(120).expand(6, 120))
    for ids, w in zip(b.ids.tolist(), b.weights.tolist()):
        assert set(ids) <= digits
        weighted = [i for i, x in enumerate(w) if x > 0]
        assert 0 < len(weighted) < len(w) / 2 + 1
        for i in weighted:   # target ids[i + 1] and its input repeat the tokens one segment length back
            assert any(ids[i + 1] == ids[i + 1 - n] and ids[i] == ids[i - n] for n in range(5, 17))


def test_copy_warmup_freezes_the_mlps_and_sets_the_embedding_scale(tmp_path):
    from sparsekv.train.cli import build, parse_args, prepare_data
    extra = ["--copy-warmup-steps", "6", "--copy-warmup-seq-len", "48", "--copy-warmup-repeat-frac", "0.5",
             "--copy-warmup-freeze-mlp", "--embed-init-std", "1.0"]
    _, work = _train(str(tmp_path), "f", *extra, "--stop-after-steps", "6")
    args = parse_args(COMMON + extra + ["--work-dir", work])
    _, init = build(args, prepare_data(args, work)[0])
    assert 0.9 < init.model.embed_tokens.weight.std().item() < 1.1
    trained_state = torch.load(os.path.join(work, STATE_FILE), weights_only=False)["model"]
    for name, p in init.state_dict().items():
        same = torch.equal(p, trained_state[name])
        if ".mlp." in name and not name.endswith("e_score_correction_bias"):
            assert same, name                       # frozen through the copy warm-up
        elif name in ("model.layers.0.self_attn.q_a_proj.weight", "model.embed_tokens.weight"):
            assert not same, name                   # attention and embeddings train


def test_the_bundled_model_matches_transformers():
    """The shipped checkpoint itself (bf16 on disk, run in fp32) loads in transformers and in sparsekv
    with matching logits on held-out code, up to the first top-k tie: its layer-0 indexer gives many
    keys a score of exactly 0 (ReLU), so ties at the k-th score start soon after row index_topk."""
    from transformers import GlmMoeDsaForCausalLM
    from sparsekv.paths import DEFAULT_MODEL_DIR
    from sparsekv.tools.eval_common import build_model, heldout_stream, load_parts, load_text_tokenizer, sequence_logits
    cfg, tensors = load_parts(DEFAULT_MODEL_DIR)
    tm = _training_model(cfg, tensors)
    code, k = heldout_stream(load_text_tokenizer(DEFAULT_MODEL_DIR)), cfg.index_topk
    windows = (code[i:i + k + 32] for i in range(0, min(len(code) - k - 32, 40_000), 1000))
    ids, rows = max(((w, _first_topk_tie(tm, w)) for w in windows), key=lambda wr: wr[1])
    assert rows >= k + 4, "no held-out window with sparse rows before a top-k tie"
    ref = GlmMoeDsaForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, :rows].float()
    model = build_model(cfg, tensors)
    ours = sequence_logits(model, ids, "sparse")[:rows]
    assert (ours - ref_logits).abs().max().item() <= logit_tolerance(model)


def test_the_time_budget_never_plans_more_steps_than_asked(tmp_path):
    """A refit at the last requested step must not add one (the bundled model's sparse stage ran 301 of 300)."""
    from sparsekv.train.trainer import Trainer, TrainOptions
    steps = {"pretrain": 200, "warmup": 10, "sparse": 10, "mtp": 10}
    trainer = Trainer(None, None, None, TrainOptions(steps=dict(steps), time_budget_s=3600.0), str(tmp_path))
    trainer._replan("pretrain", 200, seconds_per_step=0.01)     # plenty of time left
    assert trainer.state.planned["pretrain"] == 200
    trainer._replan("pretrain", 50, seconds_per_step=1e6)       # out of time: at least one more step
    assert trainer.state.planned["pretrain"] == 51


def test_far_negatives_leave_the_rows_alone(trained):
    far = _source(trained[1], seq_len=96, far_count=32, far_min_distance=500, far_layers=(0, 2))
    plain = _source(trained[1], seq_len=96)
    digits = torch.tensor(far.number_tokens)
    for step in range(3):
        a, b = far.batch(4, step), plain.batch(4, step)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.positions, b.positions) and b.far is None
        assert sorted(a.far) == [0, 2]
        for neg in a.far.values():
            assert neg.source.shape == neg.positions.shape == (6, 32)
            assert 0 <= int(neg.source.min()) and int(neg.source.max()) < 6 * 96
        # layer 0: far copies, behind every query of the row, half of them the row's own tokens
        copies = a.far[0]
        assert copies.after is None
        assert bool((copies.positions <= a.positions[:, :1] - 500).all())
        assert bool((copies.positions >= a.positions[:, :1] - (1 << 20)).all())
        assert torch.equal(copies.source[:, :16] // 96, torch.arange(6)[:, None].expand(6, 16))
        # layer 2 (its input carries context): other rows' tokens, never a digit string (a key),
        # interleaved at the row's own positions
        hay = a.far[2]
        assert bool((hay.source // 96 != torch.arange(6)[:, None]).all())
        assert not bool(torch.isin(a.ids[:, :-1].reshape(-1)[hay.source], digits).any())
        assert torch.equal(hay.positions, a.positions.gather(1, hay.after))
        assert torch.equal(copies.positions, far.batch(4, step).far[0].positions)   # deterministic
        assert torch.equal(hay.source, far.batch(4, step).far[2].source)
    assert far.batch(2, 0).far is None                                             # only in the far stage


def test_a_query_sees_only_the_haystack_negatives_placed_before_it():
    from sparsekv.train.data import FarNegatives
    from sparsekv.train.stages import visible_scores
    far_index = torch.randn(1, 4, 3)
    neg = FarNegatives(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 2, 3]]), 0.0, torch.tensor([[0, 2, 3]]))
    seen = visible_scores(far_index, neg) > -1e8
    assert seen[0].tolist() == [[False, False, False], [True, False, False], [True, False, False], [True, True, False]]


def test_kl_with_far_negatives():
    from sparsekv.train.stages import kl_to_index
    from tolerances import chain_tolerance
    torch.manual_seed(0)
    index, target = torch.randn(2, 5, 5), torch.rand(2, 5, 5)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5)

    def size(p, scores):
        """The terms' magnitudes of kl_to_index: p |log p| and p |log q| (log q = s - max - log sum
        exp, both parts' sizes), summed over keys and averaged over queries, in float64."""
        p = (p * allowed).double()
        p = p / p.sum(-1, keepdim=True)
        log_q = torch.log_softmax(scores.double(), -1)[..., :5]
        return float((p * (p.log().where(p > 0, 0.0).abs() + log_q.abs())).sum(-1).mean())

    def close(got, want, scores, magnitude):
        """Both sides in float32, each at most n roundings deep: the softmax's sum over the scores,
        the KL's over 5 keys, the mean over 10 queries and about 7 elementwise steps (exp, log,
        subtraction, product, p's normalisation); `magnitude`: the two sides' terms, averaged."""
        return abs(float(got) - float(want)) <= chain_tolerance(magnitude, scores.shape[-1] + 5 + 10 + 7)
    plain = kl_to_index(target, index, allowed)
    row = index.masked_fill(~allowed, -1e30)
    none = torch.full((2, 5, 3), -1e30)  # negatives of weight 0: the same KL
    scores = torch.cat([row, none + 10.0], -1)
    assert close(kl_to_index(target, index, allowed, none, 10.0), plain, scores, size(target, scores))
    far = torch.randn(2, 5, 3)
    # the negatives add log(1 + sum exp(far + w) / sum exp(index)) per query, target unchanged; that
    # side's terms also hold the two logsumexps
    everything = torch.cat([row, far + 2.0], -1)
    extra = (torch.logsumexp(everything, -1) - torch.logsumexp(row, -1)).mean()
    sums = float((torch.logsumexp(everything, -1).abs() + torch.logsumexp(row, -1).abs()).mean())
    assert close(kl_to_index(target, index, allowed, far, 2.0), plain + extra, everything,
                 (size(target, everything) + size(target, row) + sums) / 2)
    # smoothing 1: the target is uniform over each query's allowed keys, KL = -log n - mean log q
    log_q = torch.log_softmax(row, -1)
    count = allowed.sum(-1)
    uniform = (-count.log() - (log_q * allowed).sum(-1) / count).mean()
    assert close(kl_to_index(target, index, allowed, smoothing=1.0), uniform, row, size(allowed.float(), row))


def test_far_stage_from_an_exported_model_trains_only_layer_0s_indexer(trained, tmp_path):
    out, work = str(tmp_path / "far"), str(tmp_path / "far.work")
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    assert train_main(common + ["--out", out, "--work-dir", work, "--init-from", trained[0], "--steps", "0,0,0,0,24",
                                "--far-negatives", "64", "--far-min-distance", "200"]) == 0
    before = load_file(os.path.join(trained[0], "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.layers.0.self_attn.indexer.") for k in changed)
    hist = [h for h in _history(work) if h["stage"] == "far"]
    assert len(hist) == 24
    first, last = _first_last(hist, "far", "kl")
    assert last < first
    assert _first_last(hist, "far", "far_above_recent_L0")[1] < _first_last(hist, "far", "far_above_recent_L0")[0]
    info = json.load(open(os.path.join(out, "training.json")))
    assert list(info["heldout"]) == ["far"] and info["init_from"]["path"] == trained[0]
    # the machine that made the weights, in each run of a chain (float rounding follows the CPU)
    for run in (info, info["init_from"]["training"]):
        assert run["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert run["machine"]["torch"] == torch.__version__ and run["machine"]["cpu"]
    assert json.load(open(os.path.join(out, "config.json"))) == json.load(open(os.path.join(trained[0], "config.json")))


def test_far_stage_on_a_later_full_layer_trains_only_its_indexer(trained, tmp_path):
    out, work = str(tmp_path / "far2"), str(tmp_path / "far2.work")
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    assert train_main(common + ["--out", out, "--work-dir", work, "--init-from", trained[0], "--steps", "0,0,0,0,16",
                                "--far-negatives", "64", "--far-min-distance", "200", "--far-layers", "2"]) == 0
    before = load_file(os.path.join(trained[0], "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.layers.2.self_attn.indexer.") for k in changed)
    hist = [h for h in _history(work) if h["stage"] == "far"]
    assert all("haystack_above_target_L2" in h and "far_above_recent_L0" not in h for h in hist)
    first, last = _first_last(hist, "far", "kl")
    assert last < first
    # layer 1 is a shared layer: it has no indexer of its own to train
    assert train_main(common + ["--out", out + "x", "--work-dir", work + "x", "--init-from", trained[0], "--steps",
                                "0,0,0,0,4", "--far-negatives", "8", "--far-layers", "1"]) == 2


def test_far_stage_flags_are_checked(tmp_path, capsys):
    base = ["--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "w")]
    assert train_main(["--steps", "1,1,1,1,5"] + base) == 2
    assert "--far-negatives" in capsys.readouterr().err
    assert train_main(["--steps", "0,0,0,0,5", "--far-negatives", "8", "--init-from", str(tmp_path / "none")] + base) == 2
    assert "--init-from" in capsys.readouterr().err
    assert train_main(["--steps", "0,0,0,0,5", "--far-negatives", "8", "--far-layers", "0,x"] + base) == 2
    assert "--far-layers" in capsys.readouterr().err


def _no_steps(tmp_path, name: str, *extra) -> list[str]:
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    return common + ["--steps", "0,0,0,0", "--out", str(tmp_path / name), "--work-dir", str(tmp_path / "w"), *extra]


def test_a_work_dir_whose_state_does_not_load_or_a_bare_init_from_is_a_usage_error(tmp_path, capsys):
    """A truncated state (or another model's) and an --init-from directory without weights: one line, exit 2."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / STATE_FILE).write_bytes(b"not a checkpoint")
    assert train_main(_no_steps(tmp_path, "a")) == 2
    err = capsys.readouterr().err
    assert "does not resume this run" in err and "--fresh" in err and "Traceback" not in err
    assert train_main(_no_steps(tmp_path, "a", "--fresh")) == 0  # --fresh starts over
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert train_main(_no_steps(tmp_path, "b", "--init-from", str(bare))) == 2
    assert "no model.safetensors there" in capsys.readouterr().err


def test_the_export_replaces_the_output_whole_or_not_at_all(tmp_path, monkeypatch):
    """With --overwrite the output becomes the new export: files only the old one had go, and an export cut
    short (a full disk, Ctrl-C) leaves the old directory as it was, with no partial directory beside it."""
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "stale.safetensors").write_text("old")
    from sparsekv.train import export as export_module

    def cut_short(model, raw, tok, out_dir, *a, **kw):
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, "config.json"), "w").write("half")
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(export_module, "export", cut_short)
        with pytest.raises(OSError, match="No space"):
            train_main(_no_steps(tmp_path, "m", "--overwrite"))
    assert sorted(os.listdir(out)) == ["config.json", "stale.safetensors"] and (out / "config.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["m", "w"]
    assert train_main(_no_steps(tmp_path, "m", "--overwrite")) == 0
    assert "stale.safetensors" not in os.listdir(out) and json.loads((out / "config.json").read_text())["model_type"]
    assert sorted(os.listdir(tmp_path)) == ["m", "w"]


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    from sparsekv.train import trainer as trainer_module

    def interrupted(self, log=print):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer_module.Trainer, "run", interrupted)
    assert train_main(_no_steps(tmp_path, "m")) == 130
    assert "the same command resumes" in capsys.readouterr().err


def test_a_cuda_device_this_torch_lacks_is_refused_before_any_work_as_generate_says_it(tmp_path, monkeypatch, capsys):
    """`train --device cuda` on a torch without CUDA: the line `generate --device cuda` prints, exit 2,
    before the data is prepared (it was an AssertionError after it)."""
    from sparsekv.__main__ import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_main(_no_steps(tmp_path, "a", "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "w").exists(), err
    assert main(["generate", "--prompt-token-ids", "1,2", "--device", "cuda"]) == 2
    said_by_generate = capsys.readouterr().err.splitlines()[-1].removeprefix("sparsekv generate: ")
    assert err.strip() == f"sparsekv train: {said_by_generate}" and "no CUDA device" in said_by_generate


@pytest.mark.parametrize("flag, value, message", [
    ("--embed-init-std", "-1", "--embed-init-std must be"), ("--max-files", "0", "--max-files"),
    ("--device", "tpu", "--device must be cpu, cuda or cuda:N"), ("--synth-frac", "5", "--synth-frac must be in"),
    ("--time-budget-minutes", "nan", "--time-budget-minutes"), ("--far-smoothing", "2", "--far-smoothing"),
    ("--copy-warmup-seq-len", "0", "--copy-warmup-seq-len")])
def test_a_bad_training_option_is_a_usage_error(tmp_path, capsys, flag, value, message):
    try:
        code = train_main(_no_steps(tmp_path, "a", flag, value))
    except SystemExit as e:  # argparse's type checks
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
