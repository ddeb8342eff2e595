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


def test_probe_length_0_turns_the_probe_off(tmp_path):
    """docs/training.md and --help: `--probe-length 0` turns the held-out retrieval probe off (it was
    refused by the parser: "must be >= 1")."""
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    out, work = str(tmp_path / "m"), str(tmp_path / "w")
    assert train_main(common + ["--steps", "2,0,0,0", "--probe-length", "0", "--out", out, "--work-dir", work]) == 0
    heldout = json.load(open(os.path.join(out, "training.json")))["heldout"]
    assert list(heldout) == ["pretrain"] and "loss_dense" in heldout["pretrain"]
    assert "answer_token_acc" not in heldout["pretrain"]


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


def test_haystack_negatives_with_a_batch_of_one_row_are_refused_before_any_work(tmp_path, capsys):
    """A later full layer's far negatives are other rows' tokens (data.haystack_negatives): --batch-size 1
    cannot give any. A usage error before the data is prepared, not a ValueError traceback from the
    first far step."""
    common = [a for a in COMMON if a not in ("--steps", STEPS)] + ["--batch-size", "1"]   # (the last one counts)
    assert train_main(common + ["--steps", "0,0,0,0,5", "--far-negatives", "8", "--far-layers", "0,2",
                                "--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "--batch-size" in err and "--far-layers" in err and "Traceback" not in err
    assert not (tmp_path / "w").exists()
    # layer 0 alone: far copies need no other row
    assert train_main(common + ["--steps", "0,0,0,0,2", "--far-negatives", "8", "--out", str(tmp_path / "y"),
                                "--work-dir", str(tmp_path / "w0")]) == 0

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
    ("--far-smoothing", "1", "--far-smoothing must be in [0, 1)"),
    ("--copy-warmup-seq-len", "0", "--copy-warmup-seq-len"),
    # far copies are drawn log-uniformly from this distance on: 0 was accepted, then log(0) failed mid-run
    ("--far-min-distance", "0", "--far-min-distance")])
def test_a_bad_training_option_is_a_usage_error(tmp_path, capsys, flag, value, message):
    try:
        code = train_main(_no_steps(tmp_path, "a", flag, value))
    except SystemExit as e:  # argparse's type checks
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


# -- mutation-testing additions: data, stages, the trainer's schedules and the CLI's edges ----------

def _tiny_model(aux_indexers: bool = True):
    """A random model of the test preset (no training, no corpus)."""
    from sparsekv.train.cli import PRESETS
    from sparsekv.train.export import hf_config, model_config
    from sparsekv.train.model import GlmDsaForTraining
    torch.manual_seed(0)
    return GlmDsaForTraining(model_config(hf_config(PRESETS["test"], 128, 0)), aux_indexers=aux_indexers)


def test_the_stdlib_walk_leaves_out_tests_site_packages_and_hidden_dirs(tmp_path):
    from sparsekv.train.data import stdlib_files
    for rel in ("a.py", "pkg/b.py", "pkg/c.txt", "test/t.py", "pkg/tests/t.py", "idlelib/idle_test/t.py",
                "site-packages/x.py", ".hidden/h.py", "idlelib/i.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert stdlib_files(str(tmp_path)) == ["a.py", "idlelib/i.py", "pkg/b.py"]


def test_the_held_out_split_is_the_small_share_and_depends_only_on_the_path():
    """docs: a file is held out when crc32(path) % 20 == 0 (about 5%), the rest trains."""
    import zlib
    from sparsekv.train.data import is_heldout, stdlib_files
    files = stdlib_files()
    held = [f for f in files if is_heldout(f)]
    assert 0 < len(held) < len(files) / 2
    assert all(zlib.crc32(f.encode()) % 20 == 0 for f in held)


def test_the_token_stream_ends_every_file_with_eos(trained):
    from sparsekv.train.data import tokenize_stream
    from sparsekv.train.tokenizer import EOS, load_tokenizer
    tok = load_tokenizer(trained[1])
    eos = tok.token_to_id(EOS)
    stream = tokenize_stream(tok, ["x = 1\n", "y = 2\n", "z"], eos).tolist()
    assert stream.count(eos) == 3 and stream[-1] == eos
    assert tok.decode(stream[:stream.index(eos)]) == "x = 1\n"


def test_pose_with_no_room_to_skip_keeps_contiguous_positions():
    """--pose-max-position equal to --seq-len leaves no skip to draw: plain positions, not a math error."""
    import random
    from sparsekv.train.data import pose_positions
    for max_position in (8, 16):
        assert torch.equal(pose_positions(16, max_position, random.Random(0), 0.0), torch.arange(16))
    skipped = pose_positions(16, 1 << 20, random.Random(0), 0.0)
    assert skipped[0] == 0 and int((skipped.diff() != 1).sum()) == 1   # one cut, a skip after it


def test_answer_weights_fall_exactly_on_the_answer_targets(trained):
    """Weight i belongs to target ids[i + 1]: each weighted run of targets is one whole answer
    (` 12345.\\n`, or a variable chain ` b = a = 12345\\n`), not the question's last token."""
    import re
    from sparsekv.train.tokenizer import load_tokenizer
    tok = load_tokenizer(trained[1])
    src = _source(trained[1], synth_frac=1.0)
    runs = 0
    for step in range(3):
        b = src.batch(0, step)
        for ids, w in zip(b.ids.tolist(), b.weights.tolist()):
            weighted = [i for i, x in enumerate(w) if x > 1]
            starts = [i for i in weighted if i - 1 not in weighted]
            for s in starts:
                e = s
                while e + 1 in weighted:
                    e += 1
                text = tok.decode(ids[s + 1:e + 2])
                assert re.fullmatch(r" \d+\.\n| \w+ = \w+ = \d+\n", text), (text, tok.decode(ids[s - 8:e + 2]))
                runs += 1
    assert runs >= 6


def test_the_retrieval_probe_scores_exactly_the_answer_tokens(trained):
    import re
    from sparsekv.train.data import retrieval_probe
    from sparsekv.train.tokenizer import load_tokenizer
    tok = load_tokenizer(trained[1])
    heldout = torch.load(os.path.join(trained[1], "corpus.pt"))["heldout"]
    ids, mask = retrieval_probe(tok, heldout, 256, per_task=2)
    assert ids.shape == (8, 256) and mask.shape == (8, 255)
    for row, m in zip(ids, mask):
        text = tok.decode(row[1:][m].tolist())
        assert re.fullmatch(r" \d+\.\n| \w+ = \w+ = \d+\n", text), text
        assert bool(m[-1]) and m.nonzero()[0].item() + int(m.sum()) == 255   # one run, at the end


def test_export_keeps_the_router_bias_and_indexer_weights_proj_in_fp32(trained):
    """--save-dtype bfloat16 (the default) stores bf16, except what the reference keeps in fp32."""
    tensors = load_file(os.path.join(trained[0], "model.safetensors"))
    fp32 = {n for n, t in tensors.items() if t.dtype == torch.float32}
    assert fp32 == {n for n in tensors if n.endswith(("e_score_correction_bias", "weights_proj.weight"))}
    assert {n.rsplit(".", 2)[-2] for n in fp32} == {"gate", "weights_proj"}   # both kinds are there
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in fp32)


def test_the_lm_loss_is_the_weighted_mean_over_targets():
    from sparsekv.train.stages import lm_loss
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none")
    one = torch.zeros(2, 5)
    one[1, 3] = 2.0   # a single weighted target: the loss is its cross-entropy, whatever its weight
    assert lm_loss(logits, targets, one).item() == ce[8].item()


def test_mtp_acceptance_compares_the_draft_with_the_target_models_next_row():
    """Draft row p predicts token p + 2, which the target model gives at row p + 1: a draft equal to
    the target model's logits[:, 1:] is accepted always (TV 0); disjoint distributions have TV 1."""
    from sparsekv.train.stages import mtp_loss, total_variation
    model = _tiny_model()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets, pos = ids[:, :-1], ids[:, 1:], torch.arange(16).expand(2, 16)
    real = model.mtp_forward

    def exact_draft(inputs, pos, hidden, sparse, want_probs=False):
        _, trace = real(inputs, pos, hidden, sparse=sparse, want_probs=want_probs)
        with torch.no_grad():
            return model(inputs, pos, sparse=True).logits[:, 1:], trace
    model.mtp_forward = exact_draft
    for sparse_draft in (False, True):
        assert mtp_loss(model, inputs, targets, pos, sparse_draft, 1.0)[1]["accept"] == 1.0
    far_apart = torch.tensor([[[100.0, -100.0]]])
    assert total_variation(far_apart, -far_apart).item() == 1.0 and total_variation(far_apart, far_apart).item() == 0.0


def test_probe_metrics_count_answer_tokens_and_whole_answers():
    """Only the answer targets count: a model right on every answer and wrong everywhere else scores 1."""
    from sparsekv.train.stages import probe_metrics
    vocab = 16
    ids = torch.randint(0, vocab, (5, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(5, 11, dtype=torch.bool)
    mask[:, -3:] = True

    class Oracle(torch.nn.Module):
        def __init__(self, wrong_rows=()):
            super().__init__()
            self.p, self.wrong_rows = torch.nn.Parameter(torch.zeros(1)), wrong_rows

        def forward(self, x, pos):
            targets = ids[:, 1:]
            want = torch.where(mask, targets, (targets + 1) % vocab)
            for r in self.wrong_rows:
                want[r, -1] = (targets[r, -1] + 1) % vocab
            class Out:
                logits = torch.nn.functional.one_hot(want, vocab).float()
            return Out()
    assert probe_metrics(Oracle(), ids, mask, batch_size=5) == {"answer_token_acc": 1.0, "answer_exact": 1.0}
    got = probe_metrics(Oracle(wrong_rows=(1,)), ids, mask, batch_size=5)
    assert got == {"answer_token_acc": 14 / 15, "answer_exact": 4 / 5}


def test_the_learning_rate_schedule_warms_up_then_falls_from_1_to_a_tenth():
    from sparsekv.train.trainer import cosine
    assert cosine(0.0, 0.2) < cosine(0.1, 0.2) < 1.0
    assert cosine(0.2, 0.2) == 1.0 and cosine(1.0, 0.2) == 0.1
    assert cosine(0.5, 0.0) < cosine(0.4, 0.0)


def test_the_main_learning_rate_is_one_cosine_across_pretrain_and_sparse(tmp_path):
    """The sparse stage continues the main schedule where pretraining left it (no second warm-up)."""
    from sparsekv.train.trainer import Trainer, TrainOptions
    steps = {"pretrain": 100, "warmup": 10, "sparse": 50, "mtp": 10, "far": 0}
    trainer = Trainer(None, None, None, TrainOptions(steps=steps), str(tmp_path))
    main = [trainer._lr("pretrain", s)["main"] for s in range(20, 100)] + \
        [trainer._lr("sparse", s)["main"] for s in range(50)]
    assert main[0] == trainer.opts.lr and all(b <= a for a, b in zip(main, main[1:]))


def test_the_time_budget_gives_each_stage_its_share(tmp_path):
    """Shares 50/10/30/10%: with 1000 s and 1 s per step, pretraining fits 500 steps; after it spent
    400 s, the warm-up fits what is left of the first 60%."""
    from sparsekv.train.trainer import Trainer, TrainOptions
    steps = {"pretrain": 10_000, "warmup": 10_000, "sparse": 10_000, "mtp": 10_000, "far": 0}
    trainer = Trainer(None, None, None, TrainOptions(steps=dict(steps), time_budget_s=1000.0), str(tmp_path))
    trainer._replan("pretrain", 0, seconds_per_step=1.0)
    assert trainer.state.planned["pretrain"] == 500
    trainer.state.elapsed["pretrain"] = 400.0
    trainer._replan("warmup", 0, seconds_per_step=1.0)
    assert trainer.state.planned["warmup"] == 200


def test_expert_bias_balancing_raises_the_underloaded_and_only_counts_training_steps(tmp_path):
    from sparsekv.train.trainer import Trainer, TrainOptions
    model = _tiny_model()
    moe = model.moe_layers()[0]
    moe.gate.load.copy_(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    moe.balance(0.5)
    assert moe.gate.e_score_correction_bias.tolist() == [-0.5, 0.5, 0.0, 0.0] and moe.gate.load.sum() == 0
    ids, pos = torch.randint(0, 128, (1, 9)), torch.arange(9)[None]
    model.eval()
    with torch.no_grad():
        model(ids, pos)
    assert all(m.gate.load.sum() == 0 for m in model.moe_layers())   # held-out figures count nothing
    model.train()
    with torch.no_grad():
        model(ids, pos)
    assert moe.gate.load.sum() == 9 * model.cfg.num_experts_per_tok
    trainer = Trainer(model, None, None, TrainOptions(steps={"warmup": 1}), str(tmp_path))
    bias = [m.gate.e_score_correction_bias.clone() for m in model.moe_layers()]
    trainer._balance("warmup")   # experts do not train: the bias stays, the load is forgotten
    assert all(torch.equal(b, m.gate.e_score_correction_bias) and m.gate.load.sum() == 0
               for b, m in zip(bias, model.moe_layers()))


def test_the_indexer_learns_only_from_its_own_loss():
    """docs: the indexer input is detached, so the KL reaches the indexers and nothing else."""
    from sparsekv.train.stages import indexer_loss
    model = _tiny_model()
    ids, pos = torch.randint(0, 128, (2, 24)), torch.arange(24).expand(2, 24)
    for sparse in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(ids, pos, sparse=sparse, want_index=True, want_probs=True)
        indexer_loss(out.traces, model.cfg.indexer_types, sparse=sparse).backward()
        grads = {n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())}
        assert grads and all(".indexer." in n for n in grads), sorted(grads)[:4]


def test_an_interrupted_run_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    """--checkpoint-every 5, Ctrl-C during step 8: the state holds step 5, and the same command resumes."""
    from sparsekv.train import trainer as trainer_module
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    argv = common + ["--steps", "10,0,0,0", "--checkpoint-every", "5", "--out", str(tmp_path / "m"),
                     "--work-dir", str(tmp_path / "w")]
    real = trainer_module.Trainer.train_step

    def interrupted_at_8(self, stage):
        if self.state.step == 7:
            raise KeyboardInterrupt
        return real(self, stage)
    with monkeypatch.context() as m:
        m.setattr(trainer_module.Trainer, "train_step", interrupted_at_8)
        assert train_main(argv) == 130
    state = torch.load(tmp_path / "w" / STATE_FILE, weights_only=False)["state"]
    assert (state["stage"], state["step"]) == (0, 5)
    assert train_main(argv) == 0
    assert [h["step"] for h in _history(str(tmp_path / "w"))] == list(range(1, 11))


def test_an_export_that_cannot_take_the_outputs_place_leaves_the_old_output(tmp_path, monkeypatch):
    """The rename of the new export into place fails (another file system, a full disk): the old output
    is put back whole, and nothing is left beside it."""
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("old")
    real = os.rename

    def refuse_the_new_one(src, dst):
        if ".partial-" in os.path.basename(src):
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst)
    with monkeypatch.context() as m:
        m.setattr(os, "rename", refuse_the_new_one)
        with pytest.raises(OSError, match="cross-device"):
            train_main(_no_steps(tmp_path, "m", "--overwrite"))
    assert os.listdir(out) == ["config.json"] and (out / "config.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["m", "w"]


def test_init_from_retokenizes_a_work_dirs_corpus_made_with_another_tokenizer(trained, grouped_tokenizer, tmp_path):
    from sparsekv.train.cli import parse_args, prepare_data
    from sparsekv.train.tokenizer import load_tokenizer, save_tokenizer
    work = str(tmp_path / "w")
    save_tokenizer(grouped_tokenizer, work)
    torch.save({"train": torch.tensor([1, 2, 3]), "heldout": torch.tensor([4])}, os.path.join(work, "corpus.pt"))
    args = parse_args(COMMON + ["--init-from", trained[0], "--work-dir", work, "--out", str(tmp_path / "x")])
    tok, corpus = prepare_data(args, work)
    assert tok.to_str() == load_tokenizer(trained[0]).to_str() == load_tokenizer(work).to_str()
    want = torch.load(os.path.join(trained[1], "corpus.pt"))   # the same tokenizer, the same files
    assert torch.equal(corpus["train"], want["train"]) and torch.equal(corpus["heldout"], want["heldout"])


def test_an_output_that_is_a_symlink_is_refused(tmp_path):
    from sparsekv.train.cli import UsageError, check_output_dir
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(UsageError, match="symbolic link"):
        check_output_dir(str(tmp_path / "link"), overwrite=True)
    check_output_dir(str(tmp_path / "real"), overwrite=True)


def test_a_training_step_clips_the_gradient_norm_to_1(tmp_path):
    """The step's gradients (left in place after it) have a total norm of at most 1 (a float32 norm of n
    terms is off by gamma_n, tests/tolerances.py); unclipped, this batch's are larger (1.38)."""
    from sparsekv.train.data import Batch
    from sparsekv.train.trainer import Trainer, TrainOptions
    from tolerances import gamma
    model = _tiny_model()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))

    class Source:
        def batch(self, stage, step):
            return Batch(ids, torch.arange(16).expand(2, 16), torch.ones(2, 16))
    steps = {"pretrain": 1, "warmup": 0, "sparse": 0, "mtp": 0, "far": 0}
    trainer = Trainer(model, Source(), None, TrainOptions(steps=steps), str(tmp_path))
    trainer.optimizer = trainer._make_optimizer("pretrain")
    trainer.train_step("pretrain")
    grads = torch.cat([p.grad.reshape(-1) for g in trainer.optimizer.param_groups for p in g["params"]
                       if p.grad is not None])
    assert 0 < torch.linalg.vector_norm(grads).item() <= 1 + gamma(grads.numel() + 1)


def test_the_indexer_kl_ignores_target_mass_outside_the_allowed_keys():
    """kl_to_index restricts the target to `allowed` and renormalises (its docstring): mass on keys a
    query may not use changes nothing (the model's own targets have none, so only a direct call shows it)."""
    from sparsekv.train.stages import kl_to_index
    g = torch.Generator().manual_seed(0)
    index, target = torch.randn(2, 5, 5, generator=g), torch.rand(2, 5, 5, generator=g)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5)
    assert kl_to_index(target, index, allowed).item() == kl_to_index(target * allowed, index, allowed).item()


# -- mutation-testing additions (2): the tokenizer's and config's EOS, edges of the data, resuming
# an older state, the schedules around the copy warm-up and the CLI's flags ------------------------

def test_the_export_names_the_same_eos_in_its_config_and_its_tokenizer(trained):
    """A user's generation stops at the config's eos_token_id, a transformers tokenizer pads and ends
    with its eos_token: both are <|endoftext|>."""
    from transformers import AutoTokenizer
    from sparsekv.train.tokenizer import EOS, load_tokenizer
    out, _ = trained
    cfg = json.load(open(os.path.join(out, "config.json")))
    eos = load_tokenizer(out).token_to_id(EOS)
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == eos
    hf = AutoTokenizer.from_pretrained(out)
    assert hf.eos_token == hf.pad_token == EOS and hf.eos_token_id == eos


def test_train_tokenizer_refuses_a_digit_group_above_3():
    from sparsekv.train.tokenizer import train_tokenizer
    with pytest.raises(ValueError, match="digit_group must be 1, 2 or 3"):
        train_tokenizer(["x = 1\n"], 300, digit_group=4)


def test_the_config_has_one_indexer_type_per_layer():
    """A pattern longer than the model (as `tiny`'s FSFSS would be for 4 layers) is cut to its layers."""
    from sparsekv.train.cli import PRESETS
    from sparsekv.train.export import hf_config
    cfg = hf_config(dict(PRESETS["test"], index_topk_pattern="FSFSFS"), 128, 0)
    assert cfg["indexer_types"] == ["full", "shared", "full", "shared"]


def test_a_corpus_of_few_files_still_holds_out_one_and_its_last_window_counts():
    """--max-files under 10 keeps one held-out file (held-out rows need one); a held-out stream of
    exactly one window gives that window."""
    from sparsekv.train.data import heldout_rows, read_split
    train, heldout = read_split(max_files=5)
    assert len(train) == 5 and len(heldout) == 1
    stream = torch.arange(9)
    assert torch.equal(heldout_rows(stream, 8, 1), stream[None])
    assert heldout_rows(torch.arange(20), 8, 4).tolist() == [list(range(s, s + 9)) for s in (0, 2, 4, 6)]


def test_far_copies_give_exactly_the_asked_count_per_row():
    from sparsekv.train.data import far_copies
    for count in (5, 6):
        neg = far_copies(2, 8, torch.zeros(2, dtype=torch.long), count, 4, 100, "s")
        assert neg.source.shape == neg.positions.shape == (2, count)


def test_haystack_negatives_without_other_rows_are_a_clear_error():
    from sparsekv.train.data import haystack_negatives
    with pytest.raises(ValueError, match="other rows"):
        haystack_negatives(torch.arange(4)[None], 2, 100, torch.ones(1, 4, dtype=torch.bool), "s")


def test_a_short_document_sits_at_a_random_offset_in_code(trained, monkeypatch):
    """doc_min_frac < 1: each document lies whole at an offset of its own in the row, not always at its start."""
    src = _source(trained[1], seq_len=64, synth_frac=1.0, doc_min_frac=0.5)
    monkeypatch.setattr(src, "_document", lambda rng, length: ([-1] * length, [False] * (length - 1) + [True]))
    starts = set()
    for step in range(4):
        for row in src.batch(0, step).ids.tolist():
            doc = [i for i, t in enumerate(row) if t == -1]
            assert doc == list(range(doc[0], doc[0] + len(doc))) and len(doc) >= 33
            starts.add(doc[0])
    assert len(starts) > 3 and min(starts) == 0 < max(starts)


def test_batch_source_refuses_a_doc_min_frac_outside_0_1(trained):
    for frac in (0.0, 1.5):
        with pytest.raises(ValueError, match="doc_min_frac"):
            _source(trained[1], doc_min_frac=frac)


def test_the_retrieval_probe_places_its_needles_at_evenly_spaced_depths_from_0_to_1(trained, monkeypatch):
    """docs: one prompt per task and depth in linspace(0, 1, per_task)."""
    from sparsekv.train import data
    from sparsekv.train.tokenizer import load_tokenizer
    asked, real = [], data.TaskBuilder.make

    def make(self, task, length, depth, with_answer=False):
        asked.append((task, depth))
        return real(self, task, length, depth, with_answer)
    monkeypatch.setattr(data.TaskBuilder, "make", make)
    heldout = torch.load(os.path.join(trained[1], "corpus.pt"))["heldout"]
    data.retrieval_probe(load_tokenizer(trained[1]), heldout, 256, per_task=4)
    from sparsekv.train.tasks import TASKS
    assert asked == [(t, d) for t in TASKS for d in (0.0, 1 / 3, 2 / 3, 1.0)]


def test_resuming_a_state_saved_before_the_far_stage_existed(tmp_path):
    """A state whose plan lacks a stage (saved before `far` existed) resumes with the stage's requested count."""
    from sparsekv.train.trainer import Trainer, TrainOptions, TrainState
    model = _tiny_model()
    old = TrainState(stage=4, planned={"pretrain": 1, "warmup": 1, "sparse": 1, "mtp": 1})
    torch.save({"model": model.state_dict(), "state": old.__dict__, "optimizer": None}, tmp_path / STATE_FILE)
    steps = {"pretrain": 1, "warmup": 1, "sparse": 1, "mtp": 1, "far": 0}
    trainer = Trainer(model, None, None, TrainOptions(steps=steps), str(tmp_path))
    assert trainer.try_resume() and trainer.state.planned == steps
    assert trainer.run(log=lambda *_: None).done   # the 0-step far stage is skipped, not a KeyError


def test_the_copy_warmup_learning_rate_and_the_main_cosine_after_it(tmp_path):
    """The copy warm-up's first step already trains (lr > 0); the main schedule starts its own warm-up
    at the first step after the copy warm-up."""
    from sparsekv.train.trainer import Trainer, TrainOptions, cosine
    steps = {"pretrain": 110, "warmup": 10, "sparse": 50, "mtp": 10, "far": 0}
    o = TrainOptions(steps=steps, copy_warmup_steps=10, warmup_steps=20, copy_warmup_lr=1e-3)
    trainer = Trainer(None, None, None, o, str(tmp_path))
    assert trainer._lr("pretrain", 0)["main"] == o.copy_warmup_lr / o.warmup_steps
    assert trainer._lr("pretrain", 10)["main"] == o.lr * cosine(0.0, o.warmup_steps / 150)
    assert trainer._lr("sparse", 49)["main"] == o.lr * cosine(149 / 150, o.warmup_steps / 150)


def test_the_far_stage_is_outside_the_time_budget(tmp_path):
    """TIME_SHARE gives `far` nothing: a budget never shortens it."""
    from sparsekv.train.trainer import Trainer, TrainOptions
    steps = {"pretrain": 100, "warmup": 100, "sparse": 100, "mtp": 100, "far": 100}
    trainer = Trainer(None, None, None, TrainOptions(steps=dict(steps), time_budget_s=10.0), str(tmp_path))
    trainer._replan("far", 0, seconds_per_step=1.0)
    assert trainer.state.planned["far"] == 100


@pytest.mark.parametrize("stage", ["pretrain", "warmup", "sparse", "mtp", "far"])
def test_each_stage_trains_exactly_its_parameters(stage):
    """The module doc's table: pretrain everything but indexers and MTP; warmup the main model's
    indexers; sparse everything but MTP (indexers included); mtp the MTP layer; far the far layers' indexers."""
    from sparsekv.train.stages import set_trainable
    model = _tiny_model()
    mtp = f"model.layers.{model.cfg.num_hidden_layers}."
    want = {
        "pretrain": lambda n: not n.startswith(mtp) and ".indexer." not in n,
        "warmup": lambda n: not n.startswith(mtp) and ".indexer." in n,
        "sparse": lambda n: not n.startswith(mtp),
        "mtp": lambda n: n.startswith(mtp),
        "far": lambda n: n.startswith("model.layers.2.self_attn.indexer."),
    }[stage]
    got = {id(p) for p in set_trainable(model, stage, far_layers=(2,))}
    names = [n for n, _ in model.named_parameters()]
    assert {n for n, p in model.named_parameters() if id(p) in got} == {n for n in names if want(n)}
    assert any(want(n) for n in names) and not all(want(n) for n in names)


def test_the_far_stage_without_negatives_is_a_clear_error():
    from sparsekv.train.data import Batch
    from sparsekv.train.stages import stage_loss
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="--far-negatives"):
        stage_loss(_tiny_model(), "far", Batch(ids, torch.arange(8)[None], torch.ones(1, 8)), 0.0)


def test_the_mtp_stage_drafts_dense_first_then_sparse():
    """docs: the MTP layer's indexer gets a dense KL warm-up for the first half of its stage."""
    from sparsekv.train.data import Batch
    from sparsekv.train.stages import mtp_loss, stage_loss
    model = _tiny_model()
    ids = torch.randint(0, 128, (2, 25), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).expand(2, 24)
    batch = Batch(ids, pos, torch.ones(2, 24))
    with torch.no_grad():
        for progress, sparse in ((0.0, False), (0.49, False), (0.5, True), (0.9, True)):
            got = stage_loss(model, "mtp", batch, progress)[1]
            assert got == mtp_loss(model, ids[:, :-1], ids[:, 1:], pos, sparse, 1.0)[1]
        assert mtp_loss(model, ids[:, :-1], ids[:, 1:], pos, False, 1.0)[1]["kl"] != \
            mtp_loss(model, ids[:, :-1], ids[:, 1:], pos, True, 1.0)[1]["kl"]


def test_held_out_figures_are_means_over_rows_not_over_batches():
    from sparsekv.train.stages import heldout_metrics, lm_loss
    vocab = 8

    class Flat(torch.nn.Module):   # every row's loss is the same, log(vocab)
        mtp = None

        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, pos, sparse=False):
            class Out:
                logits = torch.zeros(*x.shape, vocab)
                hidden = None
            return Out()
    rows = torch.randint(0, vocab, (4, 6), generator=torch.Generator().manual_seed(0))
    per_row = lm_loss(torch.zeros(2, 5, vocab), rows[:2, 1:]).item()
    got = heldout_metrics(Flat(), rows, batch_size=2)
    assert got["loss_dense"] == got["loss_sparse"] == per_row


def test_an_aux_indexer_learns_its_own_layers_attention():
    """indexer_loss: a shared layer's auxiliary indexer is distilled towards that layer's attention, not
    towards its group's average (which its full layer's indexer learns)."""
    from sparsekv.train.model import LayerTrace
    from sparsekv.train.stages import group_attention, indexer_loss, kl_to_index
    g = torch.Generator().manual_seed(0)
    allowed = torch.ones(4, 4, dtype=torch.bool).tril().expand(1, 4, 4)

    def trace():
        probs = torch.rand(1, 4, 4, generator=g) * allowed
        return LayerTrace(index=torch.randn(1, 4, 4, generator=g).masked_fill(~allowed, -1e30),
                          probs=probs / probs.sum(-1, keepdim=True))
    traces = [trace(), trace()]
    p_bar = group_attention(traces, [0, 1])
    want = kl_to_index(p_bar, traces[0].index, allowed) + kl_to_index(traces[1].probs, traces[1].index, allowed) / 2
    assert indexer_loss(traces, ["full", "shared"], sparse=False).item() == want.item()


def test_an_empty_output_directory_needs_no_overwrite_and_an_unwritable_parent_is_refused(tmp_path, monkeypatch):
    from sparsekv.train.cli import UsageError, check_output_dir
    (tmp_path / "empty").mkdir()
    check_output_dir(str(tmp_path / "empty"), overwrite=False)
    monkeypatch.setattr(os, "access", lambda path, mode: False)   # (root may write anywhere)
    with pytest.raises(UsageError, match="not a writable directory"):
        check_output_dir(str(tmp_path / "new" / "m"), overwrite=False)


def test_init_from_a_checkpoint_missing_tensors_is_refused(trained, tmp_path):
    from safetensors.torch import save_file
    from sparsekv.train.cli import _load_exported
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.json").write_text(open(os.path.join(trained[0], "config.json")).read())
    tensors = load_file(os.path.join(trained[0], "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(part / "model.safetensors"))
    with pytest.raises(SystemExit, match="does not match its config: missing \\['model.norm.weight'\\]"):
        _load_exported(str(part), aux_indexers=False)


@pytest.mark.parametrize("layers", ["-2", "9"])
def test_far_layers_outside_the_model_are_refused(trained, tmp_path, capsys, layers):
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    assert train_main(common + ["--out", str(tmp_path / "m"), "--work-dir", str(tmp_path / "w"), "--init-from",
                                trained[0], "--steps", "0,0,0,0,4", "--far-negatives", "8",
                                "--far-layers", layers]) == 2
    assert "not full layers" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_the_default_work_dir_is_named_after_the_output(tmp_path, monkeypatch):
    """--out runs/m/ (a trailing slash, as a shell completes it) works in runs/train-m."""
    monkeypatch.chdir(tmp_path)
    common = [a for a in COMMON if a not in ("--steps", STEPS)]
    assert train_main(common + ["--steps", "0,0,0,0", "--out", str(tmp_path / "m") + os.sep]) == 0
    assert sorted(os.listdir(tmp_path / "runs")) == ["train-m"] and (tmp_path / "runs" / "train-m" / "corpus.pt").is_file()


def test_the_trainer_options_follow_the_flags():
    from sparsekv.train.cli import parse_args, train_options
    args = parse_args(["--time-budget-minutes", "2", "--copy-warmup-lr", "0.01", "--far-lr", "0.005"])
    o = train_options(args, {"pretrain": 1}, (0,))
    assert (o.time_budget_s, o.copy_warmup_lr, o.far_lr) == (120, 0.01, 0.005)


def test_digits_stay_one_per_token_whatever_the_corpus_repeats():
    """--digit-group 1 (the shipped model): a number the corpus repeats is still cut digit by digit,
    never into tokens BPE learned from the corpus."""
    from sparsekv.train.tokenizer import digit_group_of, train_tokenizer
    tok = train_tokenizer(["x = 12345 + 2024\n"] * 200, 300)
    assert digit_group_of(tok) == 1
    assert [t for t in tok.encode("y = 12345 - 2024").tokens if t.isdigit()] == list("12345") + list("2024")
