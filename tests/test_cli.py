"""The `sparsekv` command line: generate (JSON output, timing, errors) and dispatch."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import STARTUP_FLAGS
from sparsekv.__main__ import main


def test_generate_json_with_token_ids(glm_ckpt, capsys):
    assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "5,6,7,8", "--max-tokens", "4",
                 "--logprobs", "2", "--json", "--max-model-len", "64"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"
    assert all(str(t) in d for t, d in zip(out["token_ids"], out["logprobs"]))
    assert "prefill:" in captured.err and "ms/token" in captured.err
    assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "5,6,7,8", "--max-tokens", "4", "--json",
                 "--max-model-len", "64", "--repetition-penalty", "2", "--frequency-penalty", "1"]) == 0
    penalised = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(penalised["token_ids"]) == 4 and penalised["token_ids"] != out["token_ids"]


def test_generate_twice_on_a_disk_tier_serves_the_prompt_from_disk(glm_ckpt, capsys, tmp_path):
    """Each `generate` is a new process's engine: the second finds the first's pages on disk."""
    prompt = ",".join(str(5 + i % 50) for i in range(150))
    argv = ["generate", glm_ckpt[0], "--prompt-token-ids", prompt, "--max-tokens", "4", "--json", "--max-model-len",
            "256", "--prefix-cache-disk-path", str(tmp_path), "--prefix-cache-disk-bytes", "64M"]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["cached_tokens"] == 0 and runs[1]["cached_tokens_disk"] == runs[1]["cached_tokens"] == 128
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert (tmp_path / ".prefix-cache.key").exists()  # encrypted by default, under a key kept with the tier
    assert main(argv + ["--prefix-cache-disk-unencrypted"]) == 0  # plaintext pages: another namespace
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cached_tokens"] == 0


def test_generate_bad_input_is_one_clear_line(glm_ckpt, capsys):
    assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["generate", glm_ckpt[0], "--prompt", "text", "--max-model-len", "64"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "1,2", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "1,2", "--repetition-penalty", "3"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x = ", "--regex", "(ab"]) == 2   # the bundled model: it has a tokenizer
    assert "does not compile" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x = ", "--choice", "red,green", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] in ("red", "green")
    assert main(["generate", "--prompt", "x = ", "--choice", ""]) == 2  # an empty choice, not free text
    assert "choices must be non-empty strings" in capsys.readouterr().err
    assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "1,2", "--repetition-penalty", "3"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err
    assert main(["generate", "/nonexistent", "--prompt-token-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_make_tiny_model_writes_a_checkpoint_the_engine_runs(family, tmp_path, capsys):
    """docs/features.md's `sparsekv make-tiny-model DIR --family F`, then generate from it (transformers'
    DeepSeek defaults, 8 expert groups, do not divide the tiny model's 4 experts)."""
    path = str(tmp_path / family)
    assert main(["make-tiny-model", path, "--family", family]) == 0
    assert main(["generate", path, "--prompt-token-ids", "1,2,3", "--max-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]) == 3


def test_make_tiny_model_refuses_a_directory_that_holds_files_or_a_file(tmp_path, capsys):
    """As `sparsekv train --out`: a directory with files needs --overwrite, which replaces it whole (no
    old tokenizer left beside the new weights); a file is refused; nothing is written when refused."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "config.json").write_text("old")
    (held / "tokenizer.json").write_text("old")
    assert main(["make-tiny-model", str(held)]) == 2
    err = capsys.readouterr().err
    assert "sparsekv make-tiny-model: error:" in err and "--overwrite" in err and "Traceback" not in err, err
    assert sorted(p.name for p in held.iterdir()) == ["config.json", "tokenizer.json"]
    assert (held / "config.json").read_text() == "old"
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["make-tiny-model", str(a_file)]) == 2
    assert "not a directory" in capsys.readouterr().err and a_file.read_text() == "x"
    assert main(["make-tiny-model", str(held), "--overwrite"]) == 0
    assert "tokenizer.json" not in {p.name for p in held.iterdir()}
    assert json.loads((held / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "held"]  # no staging directory left
    (tmp_path / "link").symlink_to(held)
    assert main(["make-tiny-model", str(tmp_path / "link"), "--overwrite"]) == 2  # a rename would replace the link
    assert "symbolic link" in capsys.readouterr().err and (tmp_path / "link").is_symlink()


def test_make_tiny_model_that_cannot_write_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """A write that fails after the checks (a full disk) is the run's failure, exit 1, not a usage error."""
    import sparsekv.train.cli

    def full_disk(path, write):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(sparsekv.train.cli, "write_dir_whole", full_disk)
    path = str(tmp_path / "tiny")
    assert main(["make-tiny-model", path]) == 1
    err = capsys.readouterr().err
    assert f"sparsekv make-tiny-model: error: {path}: " in err and "No space left" in err and "Traceback" not in err


def test_a_missing_default_model_says_a_make_tiny_model_command_that_works(tmp_path, monkeypatch, capsys):
    import re
    from sparsekv.paths import default_model_path
    missing = tmp_path / "none"
    monkeypatch.setenv("SPARSEKV_MODEL", str(missing))
    with pytest.raises(FileNotFoundError) as error:
        default_model_path()
    command = re.search(r"`sparsekv (make-tiny-model [^`]*)`", str(error.value))
    assert command and str(missing) in command.group(1), str(error.value)
    assert main(command.group(1).split()) == 0
    assert default_model_path() == str(missing)


@pytest.mark.parametrize("command, required", [("generate", ["--prompt-token-ids", "1,2"]), ("serve", [])])
@pytest.mark.parametrize("flag, value, field", [("--threads", "-2", "num_threads"),
                                                ("--prefix-cache-ttl", "-5", "prefix_cache_ttl_s"),
                                                ("--dist-timeout", "-1", "dist_timeout_s")])
def test_an_engine_option_error_names_the_flag_not_the_config_field(command, required, flag, value, field, capsys):
    assert main([command, *required, flag, value]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith(f"sparsekv {command}: error: ")]
    assert len(error) == 1 and f"error: {flag} must be" in error[0] and field not in error[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, flag, field", [
    (["bench", "spec", "--num-speculative-tokens", "9"], "--num-speculative-tokens", "num_speculative_tokens"),
    (["bench", "batch", "--device", "cuda:99"], "error: --device 'cuda:99'", "error: device")])
def test_a_benchmarks_engine_option_error_names_its_flag(argv, flag, field, capsys):
    """A benchmark builds its engines from its own flags: an engine's ConfigError names them too."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith(f"sparsekv bench {argv[1]}: error: ")]
    assert len(error) == 1 and flag in error[0] and field not in error[0], err


def test_config_fields_in_a_message_become_flags():
    from sparsekv.__main__ import parser_for
    from sparsekv.engine_args import flags_by_dest, with_flag_names
    flags = flags_by_dest(parser_for(["generate"])[0])
    assert flags["num_threads"] == "--threads"
    assert flags["prefix_cache_disk_old_key_files"] == "--prefix-cache-disk-old-key-file"
    for message, named in (
            ("device_buffer_tokens, host_store_path apply only with kv_tiering=True",
             "--device-buffer-tokens, --host-store-path apply only with --kv-tiering"),
            ("kv_tiering needs attention='sparse': dense attention reads every position",
             "--kv-tiering needs --attention sparse: dense attention reads every position"),
            ("device 'cuda': this torch sees no CUDA device", "--device 'cuda': this torch sees no CUDA device"),
            ("quest_page_tokens 8 must divide kv_page_size 64", "--quest-page-tokens 8 must divide --kv-page-size 64"),
            ("index_topk (256) at /tmp/seed/max_model_len", "index_topk (256) at /tmp/seed/max_model_len")):
        assert with_flag_names(message, flags) == named


def test_a_flag_with_a_short_alias_is_named_by_its_long_flag():
    """-tp/-dp are aliases: an error about tensor_parallel_size names --tensor-parallel-size, as the docs do."""
    from sparsekv.__main__ import parser_for
    from sparsekv.engine_args import flags_by_dest, with_flag_names
    flags = flags_by_dest(parser_for(["serve"])[0])
    assert (flags["tensor_parallel_size"], flags["data_parallel_size"]) == ("--tensor-parallel-size", "--data-parallel-size")
    assert with_flag_names("tensor_parallel_size 3 must divide 8", flags) == "--tensor-parallel-size 3 must divide 8"


def test_every_benchmark_is_named_in_the_error_the_help_and_the_synopsis(capsys):
    """`sparsekv bench NAME` with a NAME that does not exist lists every benchmark, and so do `sparsekv
    --help` and docs/features.md's synopsis."""
    from pathlib import Path
    from sparsekv.__main__ import usage
    from sparsekv.tools.bench import SUB_BENCHMARKS
    names = ["decode", "prefill", "modes", *SUB_BENCHMARKS]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "tier"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and all(f"'{name}'" in err for name in names), err
    bench_help = next(line for line in usage().splitlines() if line.split()[:1] == ["bench"])
    assert [name for name in names if name not in bench_help.replace("|", " ").split()] == []
    features = (Path(__file__).resolve().parent.parent / "docs" / "features.md").read_text()
    synopsis = next(line for line in features.splitlines() if line.startswith("sparsekv bench "))
    assert sorted(synopsis.split()[2].split("|")) == sorted(names)
    with pytest.raises(SystemExit) as exit_info:  # a sub-benchmark after an option: its options were never read
        main(["bench", "--threads", "1", "tiers"])
    assert exit_info.value.code == 2 and "sparsekv bench tiers [options]" in capsys.readouterr().err


def test_a_benchmarks_sizes_below_one_are_usage_errors_before_it_runs(monkeypatch, capsys):
    """The counts a sub-benchmark checks itself (run_bench's `positive`, plain integers to argparse)."""
    from sparsekv.tools import bench_batch, bench_transfer
    for module in (bench_batch, bench_transfer):
        monkeypatch.setattr(module, "run", lambda args: pytest.fail("the benchmark ran"))
    for argv, flag in ((["bench", "batch", "--batch", "0"], "--batch"),
                       (["bench", "batch", "--prompt-tokens", "-1"], "--prompt-tokens"),
                       (["bench", "batch", "--sparse-batch", "0"], "--sparse-batch"),
                       (["bench", "batch", "--sparse-steps", "0"], "--sparse-steps"),
                       (["bench", "transfer", "--prompt-tokens", "0"], "--prompt-tokens")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"error: {flag} must be at least 1" in err, (argv, err)


@pytest.mark.parametrize("argv, flag, default", [(["eval", "needle"], "--heatmap", "needle_heatmap.png"),
                                                 (["rollout"], "--plot", "rollout_summary.png")])
def test_a_png_written_by_default_is_named_in_the_help(argv, flag, default, capsys):
    """eval needle's heatmap and rollout --summary's plot are written by default (docs/training.md,
    docs/rl.md), into the current directory: --help says where."""
    with pytest.raises(SystemExit):
        main(argv + ["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    entry = help_text[help_text.rindex(flag):]
    assert f"default: {default} in the current directory" in entry, entry


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_a_missing_checkpoint_is_one_clear_line_for_every_tool(tmp_path, capsys):
    """eval and bench tools name the directory that holds no checkpoint, exit 2, and print no traceback."""
    missing = str(tmp_path / "none")
    for argv in (["eval", "loss", missing], ["eval", "indexshare", missing], ["bench", "spec", "--model", missing],
                 ["bench", "tiers", "--model", missing, "--skip-sweep"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "no config.json" in err and missing in err and "Traceback" not in err, argv


def test_bench_flags_out_of_range_are_usage_errors(capsys):
    for argv in (["bench", "decode", "--contexts", "4K,4X"], ["bench", "tiers", "--contexts", "8Q"],
                 ["bench", "indexer", "--contexts", "0"], ["bench", "spec", "--prompts", "0"],
                 ["bench", "tiers", "--buffers", "1,x"], ["bench", "tiers", "--buffers", "0,2"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        assert argv[2] in capsys.readouterr().err, argv


def test_flags_out_of_range_are_usage_errors_before_any_work(capsys, serve_never_listens):
    """Each names its flag, exits 2, prints no traceback, and runs nothing first (no model load, no
    benchmark whose results could not be written, no port bound)."""
    for argv, flag in ((["serve", "--port", "70000"], "--port"), (["serve", "--port", "-1"], "--port"),
                       (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
                       (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout"),  # a drain without end
                       (["serve", "--default-max-tokens", "0"], "--default-max-tokens"),
                       (["serve", "--disaggregation-secret-file", "s"], "--disaggregation-secret-file"),
                       (["serve", "--disaggregation-send", "chunks"], "--disaggregation-send"),
                       (["serve", "--quest-page-tokens", "8"], "--quest-page-tokens"),  # without --selector quest
                       (["generate", "--prompt", "x", "--quest-page-tokens", "8"], "--quest-page-tokens"),
                       (["router", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", "70000"], "--port"),
                       *((["router", "--prefill", "http://a:1", "--decode", "http://b:2", flag, value], flag)
                         for flag, value in (("--health-interval", "0"), ("--request-timeout", "nan"),
                                             ("--worker-startup-timeout", "-1"), ("--worker-startup-timeout", "inf"),
                                             ("--affinity-prefix-chars", "-1"),
                                             ("--affinity-load-slack", "-2"), ("--max-request-body-bytes", "0"))),
                       (["bench", "decode", "--repeats", "0"], "--repeats"), (["bench", "decode", "--steps", "0"], "--steps"),
                       (["bench", "prefill", "--chunk", "0"], "--chunk"),
                       (["bench", "decode", "--threads", "-1"], "--threads"),
                       *((["bench", name, "--threads", "0"], "--threads")
                         for name in ("spec", "tiers", "indexer", "transfer", "batch", "prefix", "sampling",
                                      "admission", "kv-dtype", "parallel")),
                       (["bench", "spec", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
                       (["bench", "tiers", "--latency-steps", "0"], "--latency-steps"),
                       (["bench", "decode", "--profile", "-3"], "--profile"),
                       (["bench", "prefill", "--decode-steps", "-2"], "--decode-steps"),
                       *((["bench", "serve", flag, value], flag)
                         for flag, value in (("--request-rate", "0"), ("--request-rate", "-1"), ("--request-rate", "nan"),
                                             ("--max-concurrency", "-1"), ("--max-concurrency", "0"),
                                             ("--timeout", "0"))),
                       (["bench", "decode", "--json", "/nonexistent/x.json"], "--json"),
                       (["plan", "glm-5.2", "--plot", "/nonexistent/x.png"], "--plot"),
                       (["eval", "needle", "--json", "/tmp"], "--json"),  # a directory, not a file
                       (["eval", "needle", "--heatmap", "/nonexistent/h.png"], "--heatmap"),
                       (["eval", "loss", "--num-seqs", "0"], "--num-seqs"), (["eval", "loss", "--seq-len", "0"], "--seq-len"),
                       (["eval", "indexshare", "--num-seqs", "0"], "--num-seqs"),
                       (["rollout", "--output", "/nonexistent/ro.jsonl"], "--output"),
                       (["rollout", "--max-tokens", "-1"], "--max-tokens"), (["rollout", "--memory-mb", "0"], "--memory-mb"),
                       (["rollout", "--memory-mb", "1"], "--memory-mb"),
                       (["rl", "screen", "--actions", "a.jsonl", "--output", "/nonexistent/s.jsonl"], "--output"),
                       (["rollout", "--summary", "/nonexistent/t.jsonl"], "--summary")):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage error (plan returns its code instead)
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and flag in err and "Traceback" not in err, (argv, err)


def test_generate_reads_its_prompt_and_schema_before_the_engine_is_built(tmp_path, monkeypatch, capsys):
    """A prompt or schema option that cannot be read is a one-line error naming its flag before the
    weights load (it came after them; an empty --prompt-file or --prompt-token-ids named no flag at all,
    and an empty --json-schema generated free text)."""
    import sparsekv.llm
    monkeypatch.setattr(sparsekv.llm, "LLM", lambda *args, **kwargs: pytest.fail("the engine was built first"))
    for argv, flag in ((["--prompt-file", str(tmp_path / "none")], "--prompt-file"), (["--prompt-file", ""], "--prompt-file"),
                       (["--prompt-token-ids", "1,x"], "--prompt-token-ids"), (["--prompt-token-ids", ""], "--prompt-token-ids"),
                       (["--prompt", "x", "--json-schema", ""], "--json-schema")):
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"sparsekv generate: error: {flag}" in err and "Traceback" not in err, (argv, err)


def test_rollout_wall_time_must_be_finite_and_positive_before_any_episode(capsys):
    """--wall-time inf was accepted, then every command failed inside the sandbox (subprocess's
    communicate(timeout=inf) raises OverflowError, leaving the command running); --wall-time 0 killed
    every command at once."""
    for value in ("inf", "0", "-1", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            main(["rollout", "--wall-time", value])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--wall-time" in err and "Traceback" not in err, (value, err)


def test_rollout_temperature_outside_what_the_server_accepts_is_refused_before_any_episode(capsys):
    """--temperature inf or 1000 was accepted, then every policy call was refused by the server (it
    accepts [0, 100]) and every episode ended in an error."""
    for value in ("inf", "100.5", "-0.1", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            main(["rollout", "--temperature", value])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--temperature" in err and "Traceback" not in err, (value, err)
    from sparsekv.rollout.cli import build_rollout_parser
    args = build_rollout_parser().parse_args(["--temperature", "100"])
    assert args.temperature == 100.0


def test_an_option_file_that_is_not_utf8_or_missing_is_one_line_naming_its_flag(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\xff\xfe not text")
    bad.chmod(0o600)
    for argv, flag in ((["generate", "--prompt-file", str(bad)], "--prompt-file"),
                       (["generate", "--prompt", "x", "--json-schema", str(bad)], "--json-schema"),
                       (["serve", "--chat-template", str(bad)], "--chat-template"),
                       (["serve", "--api-key-file", str(bad)], "--api-key-file"),
                       (["serve", "--admin-api-key-file", str(bad)], "--admin-api-key-file"),
                       (["generate", "--prompt-file", str(tmp_path / "none")], "--prompt-file")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{flag} {argv[-1]}: " in err and ("not UTF-8 text" in err or "No such file" in err), err
        assert "Traceback" not in err


def test_a_device_this_torch_cannot_use_is_one_clear_line(glm_ckpt, capsys):
    for device, words in (("foo", "cpu, cuda or cuda:N"), ("cuda", "no CUDA device")):
        if device == "cuda" and torch.cuda.is_available():
            continue
        assert main(["generate", glm_ckpt[0], "--prompt-token-ids", "1,2", "--device", device]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err


def test_a_tokenizer_asked_for_and_not_found_is_an_error(glm_ckpt, tmp_path):
    from sparsekv import LLM
    from sparsekv.config import ConfigError
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        LLM(glm_ckpt[0], tokenizer=str(tmp_path), max_model_len=64)


@pytest.mark.parametrize("command, required", [("generate", ["--prompt", "x"]), ("serve", [])])
def test_cli_thread_default_is_llms(command, required):
    """Every command that builds an engine leaves num_threads to the engine's rule, as LLM(path) does:
    both resolve to the same count (threads.py)."""
    from sparsekv.__main__ import parser_for
    from sparsekv.config import EngineConfig, ModelConfig
    from sparsekv.engine_args import engine_options
    from sparsekv.paths import default_model_path
    from sparsekv.threads import resolve_num_threads
    parser, argv = parser_for([command])
    options = engine_options(parser.parse_args(argv + required))
    path = default_model_path()
    cli, llm = EngineConfig(model=path, **options), EngineConfig(model=path)
    cfg = ModelConfig.from_json(path)
    assert options["num_threads"] is None
    for cores in (1, 2, 64):
        assert resolve_num_threads(cli, cfg, cores) == resolve_num_threads(llm, cfg, cores) == 1


def test_rl_screen_and_summary_name_the_file_and_line_of_a_bad_line(tmp_path, capsys):
    """A line that is not JSON, or names an unknown tool, is one error naming the file and the line."""
    good = json.dumps({"id": 1, "task": "fizzbuzz", "tool": "read_file", "arguments": {"path": "fizzbuzz.py"}})
    bad_tool = json.dumps({"id": 2, "task": "fizzbuzz", "tool": "delete_file", "arguments": {"path": "x"}})
    for second, says in (("{not json", "not a JSON line"), (bad_tool, "unknown tool 'delete_file'")):
        actions = tmp_path / "actions.jsonl"
        actions.write_text(f"{good}\n{second}\n")
        assert main(["rl", "screen", "--actions", str(actions), "--rules-only"]) == 2
        err = capsys.readouterr().err
        assert f"{actions}:2:" in err and says in err and "Traceback" not in err, err
    trajectories = tmp_path / "t.jsonl"
    trajectories.write_text('{"task": "fizzbuzz", "episode": 0}\n{oops\n')
    assert main(["rollout", "--summary", str(trajectories), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert f"{trajectories}:2:" in err and "Traceback" not in err, err


def test_generate_prints_the_text_even_when_empty_and_token_ids_without_a_tokenizer(capsys):
    from types import SimpleNamespace
    from sparsekv.cli import _print_output
    ended_at_once = SimpleNamespace(text="", token_ids=[0])  # EOS first: no text
    _print_output(ended_at_once, as_json=False, has_tokenizer=True)
    assert capsys.readouterr().out == "\n"
    _print_output(SimpleNamespace(text="", token_ids=[5, 6]), as_json=False, has_tokenizer=False)
    assert capsys.readouterr().out == "5 6\n"


def test_bench_spec_needs_decode_steps_that_draft(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "spec", "--max-tokens", "2"])
    assert exit_.value.code == 2 and "--max-tokens" in capsys.readouterr().err


def test_generate_says_a_rank_failure_in_one_line(glm_ckpt, capsys):
    """A collective past --dist-timeout fails a rank: one line, exit 1 (it was a traceback)."""
    code = main(["generate", glm_ckpt[0], "--prompt-token-ids", "5,6,7", "--max-tokens", "2", "--max-model-len", "64",
                 "--threads", "1", "-tp", "2", "--dist-timeout", "1e-9", *STARTUP_FLAGS])
    err = capsys.readouterr().err
    assert code == 1 and "sparsekv generate: error:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("command, required", [("generate", ["--prompt", "x"]), ("serve", [])])
def test_every_engine_flag_defaults_to_the_engines_own_default_and_reaches_the_engine(command, required):
    """The engine flags are the LLM(...) keywords: each one given reaches engine_options, and each one
    left out is EngineConfig's own default (`sparsekv generate` builds the engine LLM(path) builds)."""
    import dataclasses
    from sparsekv.__main__ import parser_for
    from sparsekv.config import EngineConfig
    from sparsekv.engine_args import ENGINE_ARG_NAMES, engine_options
    parser, argv = parser_for([command])
    groups = [g for g in parser._action_groups if g.title == "engine" or (g.title or "").startswith(("parallelism", "tiered"))]
    dests = [a.dest for g in groups for a in g._group_actions]
    assert sorted(set(dests)) == sorted(ENGINE_ARG_NAMES)
    assert sorted(d for d in set(dests) if dests.count(d) > 1) == ["decode_graphs"]  # --disable-cuda-graph too
    options = engine_options(parser.parse_args(argv + required))
    assert sorted(options) == sorted(set(ENGINE_ARG_NAMES) - {"quest_page_tokens"})  # None: the engine's default
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name, value in options.items():
        field = fields[name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert value == default, (name, value, default)


@pytest.mark.parametrize("command, required", [("generate", ["--prompt", "x"]), ("serve", [])])
def test_quest_page_tokens_with_selector_quest_reach_the_engine(command, required):
    """docs/tiers.md: --quest-page-tokens is refused without --selector quest, and taken with it."""
    from sparsekv.__main__ import parser_for
    from sparsekv.config import EngineConfig
    from sparsekv.engine_args import engine_options
    from sparsekv.paths import default_model_path
    parser, argv = parser_for([command])
    options = engine_options(parser.parse_args(argv + required + ["--selector", "quest", "--quest-page-tokens", "8"]))
    assert (options["selector"], options["quest_page_tokens"]) == ("quest", 8)
    EngineConfig(model=default_model_path(), **options).validate()


def test_the_option_types_accept_their_edges_and_refuse_one_past():
    import argparse
    from sparsekv.engine_args import above, at_least, json_object, port_number, positive_finite
    assert [port_number(t) for t in ("0", "65535")] == [0, 65535]
    assert at_least(1)("1") == 1 and at_least(0.0, float)("0") == 0.0
    assert above(0.0)("1e-9") == 1e-9 and above(0.0)("inf") == float("inf")
    assert positive_finite("1e-9") == 1e-9 and json_object("{}") == {}
    for parse, text in ((port_number, "65536"), (port_number, "-1"), (at_least(1), "0"), (at_least(0.0, float), "-0.1"),
                        (at_least(0.0, float), "inf"),
                        (above(0.0), "0"), (above(0.0), "nan"), (positive_finite, "0"), (positive_finite, "inf"),
                        (positive_finite, "nan"), (json_object, "[1]"), (json_object, "1"), (json_object, "{x")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_the_startup_line_redacts_every_key_and_leaves_out_the_prompt(monkeypatch):
    """vLLM's "non-default args" line: serve's keys (flags and SPARSEKV_API_KEY) are '<redacted>', and a
    generate prompt (data, not a setting) is not in it at all."""
    from sparsekv.cli import PROMPT_ARGS, generate_parser
    from sparsekv.engine_args import non_default_args
    from sparsekv.server.auth import API_KEY_ENV
    from sparsekv.server.cli import build_parser, startup_settings
    monkeypatch.setenv(API_KEY_ENV, "env-secret")
    parser = build_parser()
    args = parser.parse_args(["--api-key", "k1", "--metrics-api-key", "k2", "--admin-api-key", "k3", "--max-num-seqs", "4"])
    settings = startup_settings(parser, args)
    assert settings == {"api_key": "<redacted>", "metrics_api_key": "<redacted>", "admin_api_key": "<redacted>",
                        "max_num_seqs": 4, API_KEY_ENV: "<redacted>"}
    parser = generate_parser()
    for source in (["--prompt", "secret text"], ["--prompt-file", "secret.txt"], ["--prompt-token-ids", "7,8"]):
        args = parser.parse_args([*source, "--max-tokens", "3"])
        assert non_default_args(parser, args, inputs=PROMPT_ARGS) == {"max_tokens": 3}, source


def test_generate_reads_every_prompt_token_id_and_an_empty_choice_is_still_a_choice():
    from sparsekv.cli import _prompt, _structured_output, generate_parser
    parser = generate_parser()
    assert _prompt(parser.parse_args(["--prompt-token-ids", "1,22,333"])) == [1, 22, 333]
    assert _structured_output(parser.parse_args(["--prompt", "x", "--choice", ""])) == {"type": "choice", "choices": [""]}
    assert _structured_output(parser.parse_args(["--prompt", "x", "--choice", "a,b"])) == {"type": "choice", "choices": ["a", "b"]}
    assert _structured_output(parser.parse_args(["--prompt", "x"])) is None


def test_bench_batch_refuses_a_negative_sparse_prompt_length_before_it_runs(monkeypatch, capsys):
    """--sparse-prompt-tokens 0 skips the sparse-regime runs; below 0 is a usage error (it was a
    traceback from torch.randint after the whole dense-regime benchmark had run)."""
    from sparsekv.tools import bench_batch
    monkeypatch.setattr(bench_batch, "run", lambda args: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "batch", "--sparse-prompt-tokens", "-1"])
    assert exit_info.value.code == 2 and "--sparse-prompt-tokens" in capsys.readouterr().err


def test_bench_tiers_counts_out_of_range_are_usage_errors_naming_their_flag(monkeypatch, capsys):
    """docs/tiers.md: the natural continuation reports the miss rate after --warmup steps, so a warmup of
    --natural-steps or more leaves no steady state (the whole run's rate was printed as the steady
    state's); --fit and --max-requests below 1 were engine errors naming config fields
    (device_kv_budget_bytes, max_num_seqs) after the checkpoint was loaded."""
    from sparsekv.tools import bench_tiers
    for name in ("natural", "sweep", "concurrency"):
        monkeypatch.setattr(bench_tiers, name, lambda *args: pytest.fail("the benchmark ran"))
    for argv, flag in ((["--skip-sweep", "--natural-steps", "8", "--warmup", "8"], "--warmup"),
                       (["--skip-sweep", "--natural-steps", "8", "--warmup", "20"], "--warmup"),
                       (["--skip-sweep", "--warmup", "-1"], "--warmup"),
                       (["--skip-sweep", "--natural-steps", "0"], "--natural-steps"),
                       (["--concurrency", "--fit", "0"], "--fit"), (["--concurrency", "--max-requests", "0"], "--max-requests")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "tiers", *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and flag in err and "Traceback" not in err, (argv, err)
    # without the natural continuation, --warmup is not read
    assert main(["bench", "tiers", "--skip-natural", "--skip-sweep", "--natural-steps", "8", "--warmup", "20"]) == 0


def test_bench_transfer_worker_options_below_one_are_usage_errors_naming_their_flag(monkeypatch, capsys):
    """--prefill-dp and --host-bytes below 1 were engine errors naming config fields (data_parallel_size,
    prefix_cache_host_bytes), raised by the worker being built."""
    from sparsekv.tools import bench_transfer
    monkeypatch.setattr(bench_transfer, "run", lambda args: pytest.fail("the benchmark ran"))
    for flag in ("--prefill-dp", "--host-bytes"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "transfer", flag, "0"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and flag in err and "Traceback" not in err, (flag, err)
