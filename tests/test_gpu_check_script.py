"""scripts/gpu_check.py runs once per lent GPU, with minutes of device time: a stage that raises or a
subprocess that hangs must not cost the stages after it. Checked here, without a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_hung_subprocess_is_killed_with_its_children_at_the_stage_timeout(gpu_check, monkeypatch, tmp_path):
    """A pytest whose server hangs (its children hold the output pipe open too) ends at the timeout."""
    monkeypatch.setattr(gpu_check, "STAGE_TIMEOUT_S", 5.0)  # time enough for the child to start its own child, even on a loaded machine
    marker = tmp_path / "child.pid"
    child = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"open({str(marker)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    result = gpu_check.run_bounded([sys.executable, "-c", child])
    assert result["timed_out"] == 5.0 and result["rc"] != 0 and result["tail"] == ["started"]
    grandchild = int(marker.read_text())
    for _ in range(100):  # killed with the group (a zombie until init reaps it, at most)
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the stage's grandchild outlived the timeout")


def test_a_stage_that_raises_is_recorded_and_the_next_stages_run(gpu_check, monkeypatch, tmp_path):
    out = tmp_path / "out.json"

    def exactness(ckpt, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "exactness", exactness)
    monkeypatch.setattr(gpu_check, "batch_decode", lambda device, path: {"ran": True})
    monkeypatch.setattr(gpu_check, "sparsekv_decode", lambda job: {"ms": 1.0})
    monkeypatch.setattr(gpu_check, "indexer_decode", lambda device, path: {"ran": True})
    monkeypatch.setattr(gpu_check, "long_prefill", lambda ckpt, device, n: {"tokens": n})
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "CKPT", str(out), "cpu", "--long", "4096"])
    gpu_check.main()
    result = json.loads(out.read_text())
    assert "illegal memory access" in result["exactness"]["error"] and result["exactness"]["traceback"]
    assert result["batch"] == {"ran": True} and result["long_prefill"] == {"tokens": 4096}
    assert result["decode"] == {"4096": {"ms": 1.0}}
