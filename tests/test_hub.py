"""Models by Hugging Face repo id (sparsekv/hub.py), resolved offline from a real HF cache layout.

The cache is built here the way huggingface_hub lays it out (`models--org--name/refs/<ref>` holding a
commit hash, `snapshots/<commit>/<file>` symlinked to `blobs/<etag>`) from the tiny checkpoint; the Hub
is never reached: offline mode is on, and the one online path is a stand-in `snapshot_download`.
"""
from __future__ import annotations

import hashlib
import os
import shutil

import httpx
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from sparsekv.hub import MODEL_FILES, ModelNotFound, resolve_model
from test_server_util import start_subprocess_server, tiny_checkpoint, wait_healthy

REPO_ID = "zai-org/GLM-tiny"
COMMIT, OTHER_COMMIT = "a" * 40, "b" * 40


def _etag(path: str) -> str:
    """The blob name huggingface_hub gives a file: sha256 for LFS files (weights), git's blob sha1 otherwise."""
    data = open(path, "rb").read()
    if path.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: str, repo_id: str, checkpoint: str, commit: str, refs: tuple[str, ...] = ("main",)) -> str:
    """`checkpoint`'s files as snapshot `commit` of `repo_id` in the HF cache `cache`; `refs` point at it."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in os.listdir(checkpoint):
        etag = _etag(os.path.join(checkpoint, name))
        shutil.copyfile(os.path.join(checkpoint, name), os.path.join(repo, "blobs", etag))
        os.symlink(os.path.join("..", "..", "blobs", etag), os.path.join(snapshot, name))
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def hf_home(tmp_path, checkpoint, monkeypatch):
    """HF_HOME with REPO_ID at COMMIT (main, v1) and OTHER_COMMIT (v2, no tokenizer); offline."""
    home = tmp_path / "hf"
    cache = str(home / "hub")
    add_snapshot(cache, REPO_ID, checkpoint, COMMIT, ("main", "v1"))
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    for name in os.listdir(other):
        if name.startswith("tokenizer"):
            os.remove(other / name)
    add_snapshot(cache, REPO_ID, str(other), OTHER_COMMIT, ("v2",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)  # read at import; the process started before
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_a_repo_id_resolves_to_its_cached_snapshot_by_ref_or_commit(hf_home):
    snapshots = hf_home / "hub" / "models--zai-org--GLM-tiny" / "snapshots"
    assert resolve_model(REPO_ID) == str(snapshots / COMMIT)
    assert resolve_model(REPO_ID, "v1") == str(snapshots / COMMIT)
    assert resolve_model(REPO_ID, "v2") == str(snapshots / OTHER_COMMIT)
    assert resolve_model(REPO_ID, OTHER_COMMIT) == str(snapshots / OTHER_COMMIT)
    assert os.path.islink(snapshots / COMMIT / "config.json")  # a real cache layout, read through its links


def test_a_local_directory_wins_over_the_cache(hf_home, tmp_path, monkeypatch, checkpoint):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoint, tmp_path / REPO_ID)
    assert resolve_model(REPO_ID) == REPO_ID
    assert resolve_model(str(tmp_path / "no-such-dir")) == str(tmp_path / "no-such-dir")  # the loader says why


def test_an_unknown_id_or_revision_names_every_place_searched(hf_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real, online = huggingface_hub.snapshot_download, []

    def recording(*args, local_files_only=False, **kwargs):
        online.append(not local_files_only)
        return real(*args, local_files_only=local_files_only, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    with pytest.raises(ModelNotFound) as e:
        resolve_model("no-org/no-model")
    msg = str(e.value)
    assert "'no-org/no-model' not found" in msg and str(tmp_path / "no-org" / "no-model") in msg
    assert str(hf_home / "hub") in msg and "revision main" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ModelNotFound, match="revision v3"):
        resolve_model(REPO_ID, "v3")
    assert online == [False, False]  # HF_HUB_OFFLINE: the cache was asked, the Hub never


def test_a_miss_downloads_only_the_checkpoint_files(hf_home, checkpoint, monkeypatch):
    """Online, a repo missing from the cache is fetched with `snapshot_download` (here a stand-in that
    fills the cache) after the cache was asked first, with patterns that keep docs and code out."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, revision, local_files_only, allow_patterns))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return add_snapshot(cache_dir, repo_id, checkpoint, COMMIT, (revision or "main",))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = resolve_model("deepseek-ai/DeepSeek-tiny", "v7")
    assert path.endswith(os.path.join("models--deepseek-ai--DeepSeek-tiny", "snapshots", COMMIT))
    assert [c[:3] for c in calls] == [("deepseek-ai/DeepSeek-tiny", "v7", True), ("deepseek-ai/DeepSeek-tiny", "v7", False)]
    listing = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "README.md", "LICENSE", "figures/arch.png",
               "inference/model.py", "inference/config_671B.json", "original/consolidated.00.pth"]
    assert sorted(filter_repo_objects(listing, allow_patterns=calls[1][3])) == sorted(listing[:8])
    assert calls[1][3] == MODEL_FILES


def test_llm_by_repo_id_matches_llm_by_directory(hf_home, checkpoint):
    from sparsekv import LLM, SamplingParams
    params = SamplingParams(max_tokens=6, temperature=0.0)
    opts = {"max_model_len": 128, "kv_page_size": 16, "max_num_seqs": 2}
    by_dir = LLM(checkpoint, **opts).generate("the rain in spain", params)[0]
    by_id = LLM(REPO_ID, **opts).generate("the rain in spain", params)[0]  # tokenizer from the snapshot too
    assert by_id.token_ids == by_dir.token_ids and by_id.text == by_dir.text
    no_tokenizer = LLM(REPO_ID, revision="v2", **opts)
    assert no_tokenizer.tokenizer is None and no_tokenizer.engine.config.model.endswith(OTHER_COMMIT)
    tokenizer_by_id = LLM(REPO_ID, revision="v2", tokenizer=REPO_ID, **opts)  # the tokenizer of main's snapshot
    assert tokenizer_by_id.engine.config.tokenizer.endswith(COMMIT)
    assert tokenizer_by_id.generate("the rain in spain", params)[0].token_ids == by_dir.token_ids
    with pytest.raises(ModelNotFound):
        LLM(REPO_ID, revision="v3", **opts)


def test_generate_by_repo_id_and_a_clear_error_for_an_unknown_one(hf_home, capsys):
    from sparsekv.__main__ import main
    assert main(["generate", REPO_ID, "--revision", "v2", "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]) == 0
    assert main(["generate", "no-org/no-model", "--prompt-token-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: model 'no-org/no-model' not found" in err and "Traceback" not in err


def test_serve_by_repo_id_from_hf_home_offline(hf_home):
    """The real process: HF_HOME and HF_HUB_OFFLINE from its environment, the id served under its name."""
    proc, url = start_subprocess_server(REPO_ID, env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(url, proc)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [REPO_ID]
        r = httpx.post(url + "/v1/completions", json={"model": REPO_ID, "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_downloaded_snapshot_without_config_json_is_not_a_model(hf_home, tmp_path, monkeypatch):
    """A repo id that downloads but holds no config.json (a dataset-like or code-only repo) is refused
    by name, not handed to the checkpoint loader."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    empty = tmp_path / "snapshot"
    empty.mkdir()
    (empty / "README.md").write_text("no model here")

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, local_files_only=False):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(empty)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model("some-org/not-a-model")
