"""One prepared accelerator check (run by hand on a lent GPU; CI never runs it).

  python scripts/gpu_check.py CKPT OUT.json [cuda|cpu] [--long N] [--tiers] [--disagg] [--needle LENGTHS]
                              [--stage-timeout S]

1. exactness on the device: greedy tokens and logprobs of the engine on the device against the
   engine on the CPU (float32) for a prompt far longer than index_topk, with chunked prefill; then
   the server on plain `cuda` (`tests/test_server_lifecycle.py -k on_cuda`: its engine thread sets
   the device by index and steps, one completion comes back), and weight updates into the model on the
   device (`tests/test_rl_engine.py -k on_cuda`: built part by part on the host, put back when a load
   fails part-way);
2. decode step time at 4K / 128K / 1M cached tokens (synthetic cache, as `sparsekv bench decode`),
   and the indexer's decode row in both score layouts (`sparsekv bench indexer --decode`, written to
   OUT.indexer-decode.json): whether keys-major should replace query-major on the device too
   (`DECODE_KEYS_MAJOR_MIN_KEYS_GPU`; on a CPU it does from 32K keys);
3. a real N-token prefill (default 1M) followed by 32 decode tokens: time and peak device memory;
4. with --tiers: the CUDA tests (tiering exactness, plain and speculative decoding; a dense-regime
   decode step captured as one CUDA graph and replayed; the engine's decode steps replayed from CUDA
   graphs per bucket against its decode path (tests/test_decode_graphs.py); decode selection page by page the same alone
   and batched, pages gathered on the device; plain rows decided on the device and penalised rows on
   the host against the CPU engine), and issue 3's
   fixed-device-budget benchmark (`sparsekv bench tiers --concurrency`: admitted, aggregate decode
   tokens/s, the batching ceiling and p99 at concurrency 1, tiering on vs off), written to
   OUT.tiers.json for CKPT and OUT.tiers-glm52.json for the glm5.2-proportions stand-in (GLM-5.2's
   ratio of weight bytes to one request's cache reads per step).
5. dense-regime decodes batched against one request at a time (`sparsekv bench batch`, 64 and 256
   requests of 128 tokens, OUT.batch64.json / OUT.batch256.json): the launches saved on a device; at 64,
   and at 4K contexts for 32 requests, also through the decode graphs (`--decode-graphs auto`: the
   steps replayed from CUDA graphs, against the same batched path without them), and MTP drafting
   (K = 3) with Quest through them, 8 requests at 1K (OUT.batch-mtp-quest.json);
6. with --disagg: prefill/decode disaggregation on the device (`tests/test_disagg_workers.py -k
   on_cuda`): a prefill and a decode worker sharing the GPU, over torch.distributed (gloo: NCCL refuses
   two ranks on one GPU) and over NIXL, against one engine on it; and the layer taps' rows copied off
   the device asynchronously (`tests/test_disagg_layers.py -k cuda`);
7. with --needle LENGTHS (e.g. 1M or 256K,1M): issue 5's passkey eval of the bundled model at those
   lengths, needle depths 0, 0.5 and 1, sparse attention with the tiered cache on the device, written
   to OUT.needle.json (and a heatmap next to it). One 1M prompt takes about 1.8 hours on this
   project's 2-core CPU (two threads, estimated; 3.5 on one); it is what a lent GPU is for.

With little device time left, `--long 4096 --tiers` skips the 1M prefill and keeps the tiering checks.
Stages run in the order exactness, serve, weights, tiers, disagg, batch, decode, indexer decode, long prefill, needle;
OUT.json is rewritten after each, so a run cut short by its time limit keeps what it measured. A stage that
raises is recorded (its error and the traceback's tail) and the next one runs; every subprocess a stage
starts (pytest, the benches) is killed with its process group after --stage-timeout seconds (default
300), so one hung stage (a server whose engine thread died, a transfer that never ends) cannot spend
the rest of the device time.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback

import torch

from sparsekv import LLM, SamplingParams
from sparsekv.tools.bench_worker import sparsekv_decode


def exactness(ckpt: str, device: str) -> dict:
    prompt = [(7 * i) % 1000 + 1 for i in range(3000)]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
    ref = LLM(ckpt, max_model_len=4096, prefill_chunk_tokens=1024).generate([prompt], params)[0]
    out = LLM(ckpt, device=device, dtype="float32", max_model_len=4096,  # against CPU's float32 (auto: bfloat16)
              prefill_chunk_tokens=1024).generate([prompt], params)[0]
    diff = max(abs(a[t] - b[t]) for a, b in zip(ref.logprobs, out.logprobs) for t in a if t in b)
    return {"tokens_equal": ref.token_ids == out.token_ids, "max_logprob_diff": diff}


def long_prefill(ckpt: str, device: str, n: int) -> dict:
    llm = LLM(ckpt, device=device, max_model_len=n + 64, max_num_seqs=1, prefill_chunk_tokens=8192,
              max_num_batched_tokens=8192)
    engine = llm.engine
    engine.add_request("long", [(7 * i) % 1000 + 1 for i in range(n)], SamplingParams(max_tokens=32, temperature=0.0))
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        if engine.step():
            first = first or time.perf_counter()
    end = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else None  # cuda:N's own
    if first is None:
        return {"tokens": n, "error": "no output came back"}
    return {"tokens": n, "prefill_s": first - t0, "decode_ms_per_token": (end - first) * 1000 / 31,
            "peak_device_gib": peak}


def main() -> None:
    ckpt, out_path = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else "cuda"
    n = int(sys.argv[sys.argv.index("--long") + 1]) if "--long" in sys.argv else 1 << 20
    contexts = [c for c in (4096, 131072, 1 << 20) if c <= n]
    stem = out_path.removesuffix(".json")
    if "--stage-timeout" in sys.argv:
        global STAGE_TIMEOUT_S
        STAGE_TIMEOUT_S = float(sys.argv[sys.argv.index("--stage-timeout") + 1])
    stages = [("exactness", lambda: exactness(ckpt, device))]
    if device.startswith("cuda"):
        stages += [("serve", serve), ("weights", weights)]
    if "--tiers" in sys.argv:  # the open issue's figures first: a run cut short by its time limit keeps them
        stages.append(("tiers", lambda: tiers(ckpt, device, stem + ".tiers.json")))
    if "--disagg" in sys.argv:
        stages.append(("disagg", disaggregation))
    stages.append(("batch", lambda: batch_decode(device, stem + ".batch.json")))
    stages += [("decode", lambda: {c: sparsekv_decode({"ckpt": ckpt, "context": c, "steps": 16, "device": device})
                                   for c in contexts}),
               ("indexer_decode", lambda: indexer_decode(device, stem + ".indexer-decode.json")),
               ("long_prefill", lambda: long_prefill(ckpt, device, n))]
    if "--needle" in sys.argv:
        lengths = sys.argv[sys.argv.index("--needle") + 1]
        stages.append(("needle", lambda: needle(device, lengths, stem + ".needle.json")))
    result = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"}
    for name, run in stages:
        release_device_memory(device)  # the peak and the memory held are each stage's own
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as e:  # noqa: BLE001 - recorded, and the next stage runs: this script runs once per lent GPU
            result[name] = {"error": repr(e), "traceback": traceback.format_exc().strip().splitlines()[-12:]}
        result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        print({name: result[name]}, flush=True)
        with open(out_path, "w") as f:  # after every stage, so a timed-out run still leaves its figures
            json.dump(result, f, indent=1)


def release_device_memory(device: str) -> None:
    """Free what earlier stages' engines held (reference cycles keep an engine until a collection)
    and restart the peak count."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


SPARSEKV = [sys.executable, "-m", "sparsekv"]  # this interpreter's, whether or not its venv is on PATH
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs"]
STAGE_TIMEOUT_S = 300.0  # --stage-timeout: the most one subprocess of a stage may run


def run_bounded(cmd: list[str], lines: int = 8) -> dict:
    """`cmd` run to its end or killed, with its whole process group (pytest's servers and workers),
    after STAGE_TIMEOUT_S: {"rc", "tail": its output's last lines, "timed_out" when it was killed}."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=STAGE_TIMEOUT_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    result = {"rc": proc.returncode, "tail": (out or "").strip().splitlines()[-lines:]}
    if timed_out:
        result["timed_out"] = STAGE_TIMEOUT_S
    return result


def serve() -> dict:
    """The server on plain `cuda`: its engine thread (server/loop.py) steps on the device."""
    return run_bounded([*PYTEST, "tests/test_server_lifecycle.py", "-k", "on_cuda"])


def weights() -> dict:
    """Weight updates into a model on the device: built part by part on the host, copied in, and put
    back when a load fails part-way."""
    return run_bounded([*PYTEST, "tests/test_rl_engine.py", "-k", "on_cuda"])


def indexer_decode(device: str, out_path: str) -> dict:
    return run_bounded([*SPARSEKV, "bench", "indexer", "--decode", "--device", device, "--contexts",
                        "16K,64K,256K,1M", "--repeats", "20", "--threads", "16", "--json", out_path])


def tiers(ckpt: str, device: str, out_path: str) -> dict:
    test = run_bounded([*PYTEST, "tests/test_tiers.py", "tests/test_speculative.py",
                        "tests/test_prefix_cache.py", "tests/test_dense_decode_batch.py", "tests/test_kv_cache_dtype.py",
                        "tests/test_decode_shapes.py", "tests/test_batched_decode.py", "tests/test_decode_graphs.py",
                        "-k", "on_cuda"], lines=16)  # the failures' and skips' summary lines, not only the count
    result = {"cuda_exactness_test": test}
    for name, model in (("", ["--model", ckpt]), ("-glm52", ["--preset", "glm5.2-proportions"])):
        bench = run_bounded([*SPARSEKV, "bench", "tiers", "--concurrency", *model, "--device", device,
                             "--threads", "16", "--json", out_path.replace(".tiers", f".tiers{name}")], lines=4)
        result[f"bench{name}_rc"], result[f"bench{name}_tail"] = bench["rc"], bench["tail"]
        if "timed_out" in bench:
            result[f"bench{name}_timed_out"] = bench["timed_out"]
    return result


def disaggregation() -> dict:
    """Both test files' results (the layer taps' as well when the workers' fail: each costs device time)."""
    workers = run_bounded([*PYTEST, "tests/test_disagg_workers.py", "-k", "on_cuda"])
    layers = run_bounded([*PYTEST, "tests/test_disagg_layers.py", "-k", "cuda"])
    return {"rc": workers["rc"] or layers["rc"], "workers": workers, "layers": layers}


def batch_decode(device: str, out_path: str) -> dict:
    """Dense-regime decodes batched against one request at a time, at 64 and 256 requests; at 64 also
    through the decode graphs (CUDA graphs), in the dense regime and at 4K contexts (32 requests); and
    MTP drafting (K = 3) with Quest through them, 8 requests at 1K contexts (OUT.batch-mtp-quest.json)."""
    result = {}
    for batch in (64, 256):
        graphs = ["--decode-graphs", "auto", "--sparse-prompt-tokens", "4096", "--sparse-batch", "32"] if batch == 64 else []
        result[batch] = run_bounded([*SPARSEKV, "bench", "batch", "--device", device, "--batch", str(batch), "--threads",
                                     "16", *graphs, "--json", out_path.replace(".batch", f".batch{batch}")], lines=14)
    result["mtp-quest"] = run_bounded([*SPARSEKV, "bench", "batch", "--device", device, "--batch", "8", "--threads", "16",
                                       "--sparse-prompt-tokens", "1024", "--sparse-batch", "8", "--sparse-drafts", "3",
                                       "--sparse-selector", "quest", "--decode-graphs", "auto",
                                       "--json", out_path.replace(".batch", ".batch-mtp-quest")], lines=14)
    return result


def needle(device: str, lengths: str, out_path: str) -> dict:
    return run_bounded([*SPARSEKV, "eval", "needle", "--tasks", "passkey", "--lengths", lengths,
                        "--depths", "0,0.5,1", "--samples", "1", "--dense-max-length", "0", "--device", device,
                        "--threads", "16", "--heatmap", out_path.removesuffix(".json") + ".png", "--json", out_path],
                       lines=12)


if __name__ == "__main__":
    main()
