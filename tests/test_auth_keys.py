"""API keys off the command line (server/auth.py): --api-key-file, SPARSEKV_API_KEY, constant-time
comparison, and keys that never reach a log or an error message."""
from __future__ import annotations

import os
import secrets

import httpx
import pytest

from sparsekv.server import auth
from sparsekv.server.auth import API_KEY_ENV, load_api_keys, read_api_key_file, tenant_for
from test_server_util import start_subprocess_server, tiny_checkpoint, wait_healthy

FILE_KEYS = "# team keys\nsk-file-alice:alice\n\n   sk-file-plain  \n"


def _key_file(tmp_path, text: str = FILE_KEYS, mode: int = 0o600) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660])
def test_a_key_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = _key_file(tmp_path, mode=mode)
    with pytest.raises(ValueError, match=f"other users may read or write it \\(mode {mode:04o}\\).*chmod 600"):
        read_api_key_file(path)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_key_file_gives_one_key_a_line(tmp_path, mode):
    path = _key_file(tmp_path, mode=mode)
    assert read_api_key_file(path) == [("sk-file-alice:alice", f"--api-key-file {path} line 2"),
                                       ("sk-file-plain", f"--api-key-file {path} line 4")]


def test_keys_from_flags_files_and_the_environment_are_all_accepted(tmp_path):
    path = _key_file(tmp_path)
    keys = load_api_keys(["sk-flag:flagteam"], [path], {API_KEY_ENV: "sk-env:envteam"})
    assert len(keys) == 4
    tenants = {key: tenant_for(keys, f"Bearer {key}") for key in ("sk-flag", "sk-file-alice", "sk-env", "sk-file-plain")}
    assert tenants["sk-flag"] == "flagteam" and tenants["sk-file-alice"] == "alice" and tenants["sk-env"] == "envteam"
    assert tenants["sk-file-plain"].startswith("key-") and "plain" not in tenants["sk-file-plain"]
    assert tenant_for(keys, "Bearer sk-file-alice:alice") is None  # the tenant is not part of the key
    assert load_api_keys([], [], {API_KEY_ENV: ""}) == {}  # set but empty: no key, auth stays off
    assert load_api_keys([], [], {API_KEY_ENV: "sk-env"}) == load_api_keys(["sk-env"], [], {})


@pytest.mark.parametrize("text,where", [("sk-secret-1:\n", "line 1"), ("ok-key\n:tenant-x\n", "line 2"),
                                        ("sk-secret-2:a\nsk-secret-2:b\n", "line 2"), ("# only a comment\n", "no keys")])
def test_a_bad_key_file_is_named_by_file_and_line_never_by_its_text(tmp_path, text, where):
    path = _key_file(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_api_keys([], [path], {})
    assert path in str(e.value) and where in str(e.value)
    assert "secret" not in str(e.value) and "tenant-x" not in str(e.value)


def test_a_bad_environment_or_flag_key_is_named_by_its_source_only():
    with pytest.raises(ValueError, match=f"^{API_KEY_ENV}: ") as e:
        load_api_keys([], [], {API_KEY_ENV: "sk-secret:"})
    assert "secret" not in str(e.value)
    with pytest.raises(ValueError, match="^--api-key: ") as e:
        load_api_keys(["sk-secret:"], [], {})
    assert "secret" not in str(e.value)


def test_every_key_is_compared_in_constant_time_whichever_matches(monkeypatch):
    """All keys are compared with compare_digest, with no early exit: the time taken does not tell
    which key (or how much of one) matched."""
    keys = load_api_keys([f"sk-{i}:t{i}" for i in range(5)], [], {})
    calls, real = [], secrets.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.secrets, "compare_digest", counting)
    for token, tenant in (("sk-0", "t0"), ("sk-4", "t4"), ("sk-x", None)):
        calls.clear()
        assert tenant_for(keys, f"Bearer {token}") == tenant
        assert len(calls) == 5 and all(len(a) == len(b) == 32 for a, b in calls)  # digests, not the keys


def test_serve_with_a_key_file_and_the_environment_never_prints_a_key(tmp_path_factory, tmp_path):
    """The real process: file and environment keys work, the command-line key too, a wrong key is a 401;
    the startup line lists the settings with the keys redacted, and no key is in any output."""
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    path = _key_file(tmp_path)
    proc, url = start_subprocess_server(model, "--api-key-file", path, "--api-key", "sk-flag:flagteam",
                                   "--log-level", "info", env={API_KEY_ENV: "sk-env:envteam"})
    try:
        wait_healthy(url, proc)
        body = {"prompt": "hello", "max_tokens": 2}
        for key, tenant in (("sk-file-alice", "alice"), ("sk-env", "envteam"), ("sk-flag", "flagteam")):
            r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert r.status_code == 200 and r.json()["sparsekv"]["tenant"] == tenant
        assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-nope"}).status_code == 401
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    line = next(line for line in output.splitlines() if "non-default args" in line)
    assert f"'api_key_file': ['{path}']" in line and "'api_key': '<redacted>'" in line
    assert f"'{API_KEY_ENV}': '<redacted>'" in line and f"'fd': {proc.args[proc.args.index('--fd') + 1]}" in line
    assert "sk-" not in output, output


def test_metrics_keys_from_flags_files_and_the_environment(tmp_path):
    """As the admin keys: kept off the command line in a private file or SPARSEKV_METRICS_API_KEY (the
    deployment's Prometheus scrapes with one), each line or value a whole key."""
    import os

    from sparsekv.server.auth import METRICS_API_KEY_ENV, load_metrics_keys, tenant_for
    path = tmp_path / "metrics.key"
    path.write_text("# prometheus\nmk-one:with-colon\n")
    os.chmod(path, 0o600)
    keys = load_metrics_keys(["mk-flag"], [str(path)], {METRICS_API_KEY_ENV: "mk-env"})
    assert all(tenant_for(keys, f"Bearer {k}") == "metrics" for k in ("mk-flag", "mk-one:with-colon", "mk-env"))
    assert tenant_for(keys, "Bearer mk-one") is None
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="--metrics-api-key-file .*chmod 600"):
        load_metrics_keys([], [str(path)], {})


def test_an_indented_comment_line_is_skipped_not_taken_as_a_key(tmp_path):
    """A `#` comment is skipped however it is indented: an indented one taken as a key would be a key
    anyone who reads the comment convention could guess."""
    path = _key_file(tmp_path, "  # rotated monthly\nsk-one\n\t# old: sk-two\n")
    assert read_api_key_file(path) == [("sk-one", f"--api-key-file {path} line 2")]


def test_the_bearer_scheme_is_matched_whatever_its_case():
    """An authentication scheme is case-insensitive (RFC 9110 11.1): `bearer KEY` is the same key as
    `Bearer KEY`; another scheme is not."""
    keys = load_api_keys(["sk-a:alice"], [], {})
    assert [tenant_for(keys, f"{scheme} sk-a") for scheme in ("Bearer", "bearer", "BEARER")] == ["alice"] * 3
    assert tenant_for(keys, "Basic sk-a") is None
