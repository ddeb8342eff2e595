"""Needle task generators (exact lengths, needle depths), eval scoring and tables on hand-made cases,
top-k overlap, the greedy IndexShare search on a tiny checkpoint, and `eval needle` end to end on the
bundled model."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from sparsekv.tools.eval_indexshare import greedy_search, overlap, pattern
from sparsekv.tools.eval_needle import accuracy, format_table, length_label
from sparsekv.tools.plan_workload import parse_tokens
from sparsekv.train.tasks import TASKS, TaskBuilder, first_number, score

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def builder():
    from sparsekv.train.data import read_split, tokenize_stream
    from sparsekv.train.tokenizer import train_tokenizer
    train, heldout = read_split(max_files=20)
    tok = train_tokenizer(train, 400)
    return TaskBuilder(tok, tokenize_stream(tok, heldout, 0).tolist(), seed=1)


def _decode(b, ids):
    return b.tok.decode(ids)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [300, 1500])
def test_prompts_have_the_exact_length_and_end_with_the_question(builder, task, length):
    s = builder.make(task, length, 0.5)
    assert len(s.prompt) == length
    tail = _decode(builder, s.prompt[-40:])
    assert tail.rstrip().endswith(("is", "is:", "=")) and s.answer.isdigit()


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_code_needle_at_the_requested_depth_on_a_line_start(builder, depth):
    s = builder.make("niah", 3000, depth)
    needle = [t for t in s.prompt[s.needle_starts[0]:]][:40]
    text = _decode(builder, needle)
    assert text.startswith("# One of the special magic numbers for ") and s.answer in text
    n_needle = len(builder.encode(text.split("\n")[0] + "\n"))
    question = _decode(builder, s.prompt[-200:]).split("\n")[-1]
    n_hay = 3000 - n_needle - len(builder.encode("\n" + question))
    start = s.needle_starts[0]
    target = round(depth * n_hay)
    assert 0 <= target - start <= 256
    # snapped back to just after the nearest token ending in a newline, if one is within 256 tokens
    hay = s.prompt[:start] + s.prompt[start + n_needle:]
    ends_line = [j for j in range(max(target - 256, 1), target + 1) if builder.tok.id_to_token(hay[j - 1]).endswith("Ċ")]
    assert start == (max(ends_line) if ends_line else (0 if target <= 256 else target))


def test_multikey_asks_for_one_of_four_keys(builder):
    s = builder.make("multikey", 2000, 0.5)
    assert len(s.needle_starts) == 4
    asked = _decode(builder, s.prompt[s.needle_starts[0]:s.needle_starts[0] + 30]).split("\n")[0]
    name = asked.split()[5]
    assert asked.endswith(f"is {s.answer}.") and _decode(builder, s.prompt[-30:]).rstrip().endswith(f"for {name} is")


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_depth_in_tokens_for_a_single_needle(builder, depth):
    """Exact check: passkey needle after round(depth * haystack) tokens, snapped to a filler line."""
    s = builder.make("passkey", 1000, depth)
    needle = builder.encode(f"The pass key is {s.answer}. Remember it. {s.answer} is the pass key.\n")
    question = builder.encode("\nWhat is the pass key? The pass key is")
    n_hay = 1000 - len(needle) - len(question)
    line = len(builder.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"))
    start = s.needle_starts[0]
    assert s.prompt[start:start + len(needle)] == needle
    assert 0 <= round(depth * n_hay) - start < line
    assert s.prompt[-len(question):] == question


@pytest.mark.parametrize("length", [1000, 1001, 1013, 4096])
def test_passkey_filler_ends_with_a_whole_sentence_before_the_question(builder, length):
    """The filler is cut at the start, never before the question: a word cut in two there
    ('The sun is yel' + question) made a model continue the filler instead of answering."""
    s = builder.make("passkey", length, 0.5)
    text = _decode(builder, s.prompt)
    assert len(s.prompt) == length
    assert text.endswith("There and back again.\n\nWhat is the pass key? The pass key is")


@pytest.mark.parametrize("n", [300, 1000, 2999])
def test_code_haystack_for_prompts_ends_with_a_whole_line(builder, n):
    for seed in range(10):
        b = TaskBuilder(builder.tok, builder.code, seed)
        hay = b.haystack("code", n, end_on_line=True)
        assert len(hay) == n and hay[-1] in b._newline
        assert _decode(b, hay) in _decode(b, builder.code)


def test_variable_chain_reads_forward(builder):
    s = builder.make("vartrack", 3000, 0.2)
    text = _decode(builder, s.prompt)
    assigned = {}
    order = []
    for ln in text.split("\n"):
        if "# VAR " in ln:
            name, value = ln.split("# VAR ")[1].split(" = ")
            assigned[name.strip()] = value.strip()
            order.append(name.strip())
    asked = text.rstrip().split("# Trace ")[1].split(":")[0]
    chain = [asked]
    while not assigned[chain[-1]].isdigit():
        chain.append(assigned[chain[-1]])
    assert len(chain) == 3 and assigned[chain[-1]] == s.answer
    assert order.index(chain[2]) < order.index(chain[1]) < order.index(chain[0])   # value first, then the chain


def test_training_documents_carry_their_answer(builder):
    s = builder.make("multikey", 600, 0.4, with_answer=True)
    assert len(s.prompt) == 600 and s.prompt[-len(s.answer_ids):] == s.answer_ids
    assert s.answer in _decode(builder, s.answer_ids)


def test_too_short_is_an_error(builder):
    with pytest.raises(ValueError, match="too short"):
        builder.make("vartrack", 20, 0.5)


@pytest.mark.parametrize("out,ok", [(" 48213.", True), ("48213", True), (" 4821", False), (" 482131", False),
                                    (" apple = river = 48213\n", True), ("", False), (" the key is 48213", True),
                                    (" 11111 48213", False)])
def test_score_hand_made(out, ok):
    assert score("48213", out) is ok


def test_first_number():
    assert first_number("x = 12 and 345") == "12" and first_number("none") is None


def test_lengths():
    assert parse_tokens("4K") == 4096 and parse_tokens("1M") == 1 << 20 and parse_tokens("300") == 300
    assert length_label(16384) == "16K" and length_label(1 << 20) == "1M" and length_label(300) == "300"


def test_accuracy_table_hand_made():
    rs = [{"task": "passkey", "length": 4096, "depth": 0.0, "attention": "sparse", "correct": True},
          {"task": "passkey", "length": 4096, "depth": 1.0, "attention": "sparse", "correct": False},
          {"task": "passkey", "length": 4096, "depth": 0.0, "attention": "dense", "correct": True},
          {"task": "niah", "length": 4096, "depth": 0.0, "attention": "sparse", "correct": True}]
    acc = accuracy(rs, ("task", "length", "attention"))
    assert acc[("passkey", 4096, "sparse")] == 0.5 and acc[("passkey", 4096, "dense")] == 1.0
    table = format_table(rs, ["passkey", "niah"], [4096])
    rows = {ln.split()[0]: ln.split()[1:] for ln in table.splitlines()[2:]}
    assert rows["passkey"] == ["50%", "100%"] and rows["niah"] == ["100%", "-"] and rows["all"] == ["67%", "100%"]


def test_overlap_hand_made():
    a = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 3]])
    b = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]])
    assert overlap(a, b) == pytest.approx(0.75)


def test_greedy_search_never_shares_layer_zero(glm_ckpt, random_prompt):
    from sparsekv.tools.eval_common import load_parts
    path, _ = glm_ckpt
    cfg, tensors = load_parts(path)          # FSSF: indexers on layers 0 and 3
    cfg = cfg.replace(index_topk=4)
    seqs = [random_prompt(24, seed=s) for s in range(2)]
    steps = greedy_search(cfg, tensors, seqs, [0, 3], lambda *_: None)
    assert [p for p, _ in steps] == ["FSSF", "FSSS"]
    assert all(loss > 0 for _, loss in steps)
    assert pattern(["full", "shared"]) == "FS"


def test_key_positions_hand_made():
    from sparsekv.tools.eval_needle import key_positions
    assert key_positions([5, 1, 2, 3, 9, 1, 2, 3, 1, 2], [1, 2, 3]) == [1, 2, 3, 5, 6, 7]
    assert key_positions([1, 2], [1, 2, 3]) == [] and key_positions([1, 2], []) == []


def test_key_share_of_a_key_whose_occurrences_overlap_reaches_one():
    """A key found twice overlapping ([1, 1] in 1, 1, 1) covers prompt positions 0, 1, 2 once each: a
    selector that picked all three surfaced the whole key (share 1, not 3/4 from counting 1 twice)."""
    from sparsekv.tools.eval_needle import AnswerRowSelections, key_positions
    assert key_positions([7, 1, 1, 1, 7], [1, 1]) == [1, 2, 3]
    rec = object.__new__(AnswerRowSelections)   # the recorder without an engine to wrap
    rec.start(5)
    rec._observe(0, None, torch.tensor([4]), torch.tensor([[1, 2, 3]]))
    assert rec.key_share(key_positions([7, 1, 1, 1, 7], [1, 1])) == {"0": 1.0}


def test_eval_needle_end_to_end_reports_the_key_selected_while_answering(tmp_path, capsys):
    """`sparsekv eval needle` on the bundled model: accuracy table, heatmap, JSON; for sparse runs the
    share of the key's tokens each full layer selected over the rows that wrote the output, equal to
    the selections the engine's model makes for those rows on prompt + output in one pass
    (eval_common.sequence_logits)."""
    from sparsekv.paths import default_model_path
    from sparsekv.tools.eval_common import build_model, heldout_stream, load_parts, load_text_tokenizer, sequence_logits
    from sparsekv.tools.eval_needle import add_args, build_samples, key_positions, main
    model = default_model_path()
    out, heat = tmp_path / "needle.json", tmp_path / "heat.png"
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args([model, "--tasks", "passkey", "--lengths", "600", "--depths", "0,1", "--samples", "1",
                         "--dense-max-length", "600", "--heatmap", str(heat), "--json", str(out)])
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "passkey" in printed and "key tokens selected while answering" in printed and heat.exists()
    results = json.loads(out.read_text())["results"]
    sparse = [r for r in results if r["attention"] == "sparse"]
    assert len(results) == 4 and len(sparse) == 2
    assert all("key_in_topk" not in r for r in results if r["attention"] == "dense")
    assert all(r["output_ids"] for r in results)
    for r in results:   # each request's tiers as it finished; tiering only for sparse attention
        assert r["metrics"]["num_prompt_tokens"] == 600
        assert ("host_kv_bytes" in r["metrics"]) == (r["attention"] == "sparse")
    assert "host KV" in printed and "tier miss rate" in printed
    tok = load_text_tokenizer(model)
    samples = build_samples(TaskBuilder(tok, heldout_stream(tok), 0), ["passkey"], 600, [0.0, 1.0], 1)
    cfg, tensors = load_parts(model)
    engine_model = build_model(cfg, tensors)
    for s, r in zip(samples, sparse):
        keys = key_positions(s.prompt, tok.encode(s.answer, add_special_tokens=False).ids)
        assert r["answer"] == s.answer and len(keys) == 2 * len(s.answer)   # the passkey needle says it twice
        rows, n0 = {}, len(s.prompt)
        answering = slice(n0 - 1, n0 - 1 + len(r["output_ids"]))   # the rows that wrote the output
        sequence_logits(engine_model, s.prompt + r["output_ids"], "sparse",
                        lambda layer, seq, sel: rows.update({layer: set(sel[answering].flatten().tolist())}))
        expected = {str(l): len(set(keys) & rows[l]) / len(keys) for l in cfg.full_layers}
        assert r["key_in_topk"] == expected and any(v > 0 for v in expected.values())


def test_eval_needle_json_keeps_every_finished_sample_when_a_run_stops(tmp_path, monkeypatch):
    """The JSON is rewritten after every sample (a 1M prompt takes hours on a CPU): a run stopped after
    its first prompt leaves that prompt's result, marked incomplete; a finished run is marked complete."""
    import sparsekv.tools.eval_needle as needle
    from sparsekv.paths import default_model_path
    out = tmp_path / "needle.json"
    p = argparse.ArgumentParser()
    needle.add_args(p)
    args = p.parse_args([default_model_path(), "--tasks", "passkey", "--lengths", "600", "--depths", "0,1",
                         "--samples", "1", "--dense-max-length", "0", "--json", str(out),
                         "--heatmap", str(tmp_path / "heat.png")])
    calls = []

    def score_then_stop(answer, text):
        calls.append(answer)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return score(answer, text)
    monkeypatch.setattr(needle, "score", score_then_stop)
    with pytest.raises(KeyboardInterrupt):
        needle.main(args)
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and [r["answer"] for r in saved["results"]] == calls[:1]
    assert not (tmp_path / "needle.json.partial").exists()
    monkeypatch.setattr(needle, "score", score)
    assert needle.main(args) == 0
    saved = json.loads(out.read_text())
    assert saved["complete"] is True and len(saved["results"]) == 2 and saved["results"][0]["answer"] == calls[0]


@pytest.mark.parametrize("flags, named", [
    (["--tasks", "passkey,haystack"], "unknown task"),
    (["--lengths", "4X"], "--lengths"),
    (["--lengths", "0"], "--lengths"),
    (["--depths", "0,1.5"], "--depths"),
    (["--depths", "half"], "--depths"),
    (["--samples", "0"], "--samples"),
])
def test_eval_needle_bad_flags_are_clear_errors(flags, named, capsys):
    """Checked before the model or the haystack is loaded: exit status 2 and the flag named on stderr."""
    from sparsekv.tools.eval_needle import add_args, main
    p = argparse.ArgumentParser()
    add_args(p)
    assert main(p.parse_args(["/nonexistent-model"] + flags)) == 2
    assert named in capsys.readouterr().err


def test_eval_needle_an_invalid_device_buffer_is_an_error_not_a_run_without_tiering(tmp_path, capsys):
    """The user's own --device-buffer-tokens below the model's index_topk: exit 2 naming the flag,
    before any prompt runs (it ran every length untiered and exited 0)."""
    from sparsekv.paths import default_model_path
    from sparsekv.tools.eval_needle import add_args, main
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args([default_model_path(), "--tasks", "passkey", "--lengths", "600", "--depths", "0",
                         "--samples", "1", "--dense-max-length", "0", "--heatmap", str(tmp_path / "heat.png"),
                         "--device-buffer-tokens", "1"])
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "sparsekv eval needle: error: --device-buffer-tokens (1) must be >=" in captured.err, captured.err
    assert "index_topk" in captured.err and "passkey" not in captured.out


def test_eval_needle_past_the_models_positions_only_with_hf_overrides(tmp_path, capsys):
    """A length past max_position_embeddings is refused up front, naming --hf-overrides, and runs with it."""
    import shutil
    from sparsekv.paths import default_model_path
    from sparsekv.tools.eval_needle import add_args, main
    model = str(tmp_path / "short")
    shutil.copytree(default_model_path(), model)
    config = json.load(open(os.path.join(model, "config.json")))
    json.dump({**config, "max_position_embeddings": 512}, open(os.path.join(model, "config.json"), "w"))
    p = argparse.ArgumentParser()
    add_args(p)
    flags = [model, "--tasks", "passkey", "--lengths", "600", "--depths", "0", "--samples", "1", "--no-tiering",
             "--dense-max-length", "0", "--heatmap", str(tmp_path / "heat.png")]
    assert main(p.parse_args(flags)) == 2
    assert "max_position_embeddings (512)" in capsys.readouterr().err
    assert main(p.parse_args(flags + ["--hf-overrides", '{"max_position_embeddings": 1024}'])) == 0
    assert "passkey" in capsys.readouterr().out


def test_eval_indexshare_refuses_more_shared_layers_than_the_model_has(capsys):
    from sparsekv.__main__ import main
    from sparsekv.config import ModelConfig
    from sparsekv.paths import default_model_path
    layers = ModelConfig.from_json(default_model_path()).num_hidden_layers
    assert main(["eval", "indexshare", "--num-shared", "99", "--no-search"]) == 2
    captured = capsys.readouterr()
    assert "--num-shared 99" in captured.err and f"at most {layers - 1}" in captured.err, captured.err
    assert "top-k overlap" not in captured.out   # refused before any work
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "indexshare", "--num-shared", "-1"])
    assert exit_info.value.code == 2 and "--num-shared" in capsys.readouterr().err


# ---------------------------------------------------------------- review: eval needle's pieces by hand

def test_eval_needle_empty_task_list_is_an_error(capsys):
    from sparsekv.tools.eval_needle import add_args, main
    p = argparse.ArgumentParser()
    add_args(p)
    assert main(p.parse_args(["/nonexistent-model", "--tasks", ","])) == 2
    assert "unknown task" in capsys.readouterr().err


def test_length_labels_only_name_whole_units():
    assert length_label(1500) == "1500" and length_label(1536) == "1536" and length_label(3 << 19) == "1536K"
    assert length_label(1024) == "1K" and length_label(3 << 20) == "3M"


def test_key_positions_find_a_key_that_ends_the_prompt():
    from sparsekv.tools.eval_needle import key_positions
    assert key_positions([9, 1, 2], [1, 2]) == [1, 2] and key_positions([1, 2], [1, 2]) == [0, 1]


def test_key_share_is_none_without_selections_and_counts_each_layer():
    """No selection while answering (the context fits in the top-k) is None, not an empty report."""
    from sparsekv.tools.eval_needle import AnswerRowSelections
    rec = object.__new__(AnswerRowSelections)   # the recorder without an engine to wrap
    rec.start(10)
    assert rec.key_share([3, 4]) is None
    rec._observe(0, None, torch.tensor([8, 9]), torch.tensor([[1, 2], [3, 5]]))   # row 8 is not answering
    rec._observe(2, None, torch.tensor([9]), torch.tensor([[3, 4]]))
    assert rec.key_share([3, 4]) == {"0": 0.5, "2": 1.0} and rec.key_share([]) is None


def test_eval_needle_engine_options_follow_the_flags():
    from sparsekv.tools.eval_needle import llm_options, needle_parser, tiering_options
    args = needle_parser().parse_args(["m", "--no-prefix-caching", "--device-buffer-tokens", "4096"])
    opts = llm_options(args, "dense", 1000)
    assert opts["enable_prefix_caching"] is False and opts["attention"] == "dense" and opts["max_model_len"] == 1000
    assert llm_options(needle_parser().parse_args(["m"]), "sparse", 1000)["enable_prefix_caching"] is True
    assert tiering_options(args) == {"kv_tiering": True, "device_buffer_tokens": 4096}


def test_make_llm_runs_untiered_and_says_why_when_the_machine_refuses_tiering(monkeypatch):
    import sparsekv.llm
    from sparsekv.config import ConfigError
    from sparsekv.tools.eval_needle import make_llm, needle_parser
    made = []

    class FakeLLM:
        def __init__(self, model, **opts):
            if opts.get("kv_tiering"):
                raise ConfigError("host store: not enough memory")
            made.append(opts)
    monkeypatch.setattr(sparsekv.llm, "LLM", FakeLLM)
    args = needle_parser().parse_args(["m"])
    llm, note = make_llm("m", "sparse", 1000, args)
    assert isinstance(llm, FakeLLM) and "kv_tiering" not in made[-1]
    assert note == "tiering not possible here (host store: not enough memory); ran without"
    assert make_llm("m", "dense", 1000, args)[1] == "tiering off"


def test_a_code_haystack_as_long_as_the_code_is_the_whole_code(builder):
    code = builder.code[:50]
    b = TaskBuilder(builder.tok, code, 0)
    assert b.haystack("code", 50) == code and b.haystack("code", 50, end_on_line=True) == code


def test_training_documents_hold_at_most_8_keys(builder):
    import re
    counts = []
    for seed in range(40):
        ids, _ = TaskBuilder(builder.tok, builder.code, seed).make_document(3000)
        text = _decode(builder, ids)
        counts.append(len(re.findall(r"^# (The pass key for|One of the special magic numbers for) \w+ is:? \d+\.$",
                                     text, re.M)))
    assert 2 <= max(counts) <= 8


def test_every_variable_chain_reads_forward(builder):
    """vartrack: the value line comes first, then `b = a`, then `c = b` (needle_starts in that order), whatever the seed."""
    for seed in range(20):
        starts = TaskBuilder(builder.tok, builder.code, seed).make("vartrack", 1000, 0.3).needle_starts
        assert starts[0] <= starts[1] <= starts[2], (seed, starts)
