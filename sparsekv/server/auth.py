"""API keys and tenants.

`--api-key KEY` or `--api-key KEY:TENANT`, repeatable; the same lines in `--api-key-file PATH` (one a
line; blank lines and `#` comments skipped; refused if other users may read or write the file); and
`SPARSEKV_API_KEY` in the environment (as vLLM reads VLLM_API_KEY). The file and the environment keep
keys off the command line, where `ps` shows them to every user of the machine. The keys of all three
are accepted. A malformed entry is reported by where it came from, never by its text.

Each key maps to a tenant, and the tenant goes on every engine request: the prefix cache must never
share entries across tenants. A key given without a tenant gets its own tenant, `key-<first 8 hex of
sha256(key)>`, so two such keys never share and the key itself never appears in logs or metrics.
Without any key every request is tenant `default`.

Admin keys (`--admin-api-key KEY`, repeatable; `--admin-api-key-file PATH`, one a line, private like
the other key file; `SPARSEKV_ADMIN_API_KEY`) are a separate set: they open the endpoints that change
what the server serves for everyone (`ADMIN_PATHS`: weight updates, pause/continue, flush_cache) and
nothing else, and no tenant key opens those. Without an admin key those endpoints are refused (403),
also on a server without --api-key: one that answers anyone must not let anyone swap its weights.

Keys are kept as SHA-256 digests and compared in constant time (`secrets.compare_digest`, which is
`hmac.compare_digest`) against all of them, as vLLM does. /health and /metrics stay public, as in vLLM
and SGLang (/metrics' per-tenant series only with a --metrics-api-key: app.metrics). Two Authorization
headers are a 400 on any path.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat

PUBLIC_PATHS = ("/health", "/health_generate", "/metrics", "/ping", "/version", "/disaggregation")  # the last: for `sparsekv router`
DEFAULT_TENANT = "default"
ADMIN_PATHS = ("/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache",
               "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")
ADMIN_API_KEY_ENV = "SPARSEKV_ADMIN_API_KEY"
METRICS_API_KEY_ENV = "SPARSEKV_METRICS_API_KEY"
TENANT_SCOPE_KEY = "sparsekv.tenant"
API_KEY_ENV = "SPARSEKV_API_KEY"
OTHERS_MAY_ACCESS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_api_keys(specs: list[str], sources: list[str] | None = None) -> dict[bytes, str]:
    """['KEY', 'KEY:TENANT', ...] -> {sha256(KEY): tenant}; raises ValueError on an empty key or tenant, or
    on a key given twice with two tenants, naming the entry's source (`sources[i]`, else --api-key)."""
    keys: dict[bytes, str] = {}
    for i, spec in enumerate(specs):
        where = sources[i] if sources else "--api-key"
        key, sep, tenant = spec.partition(":")
        if not key or (sep and not tenant):
            raise ValueError(f"{where}: an API key must be KEY or KEY:TENANT with both parts non-empty")
        digest = _digest(key)
        tenant = tenant if sep else "key-" + digest.hex()[:8]
        if keys.setdefault(digest, tenant) != tenant:
            raise ValueError(f"{where}: this API key was already given, for another tenant")
    return keys


def read_api_key_file(path: str, flag: str = "--api-key-file") -> list[tuple[str, str]]:
    """The `KEY[:TENANT]` lines of an --api-key-file (`flag`: the option that named it), each with where
    it is (`PATH line N`). Refused if group or others may read or write it (they could read the keys,
    or add one)."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    with f:
        mode = os.fstat(f.fileno()).st_mode  # of the file opened, not of whatever the path names later
        if mode & OTHERS_MAY_ACCESS:
            raise ValueError(f"{flag} {path}: other users may read or write it (mode "
                             f"{stat.S_IMODE(mode):04o}); make it private: chmod 600 {path}")
        try:
            entries = [(line.strip(), f"{flag} {path} line {n}") for n, line in enumerate(f, 1)
                       if line.strip() and not line.lstrip().startswith("#")]
        except UnicodeDecodeError as e:
            raise ValueError(f"{flag} {path}: not UTF-8 text (byte {e.start})") from None
    if not entries:
        raise ValueError(f"{flag} {path}: no keys in it")
    return entries


def load_api_keys(flags: list[str], files: list[str], environ: dict) -> dict[bytes, str]:
    """The keys of --api-key, of each --api-key-file and of SPARSEKV_API_KEY (empty or unset: none)."""
    entries = [(spec, "--api-key") for spec in flags]
    for path in files:
        entries += read_api_key_file(path)
    if environ.get(API_KEY_ENV):
        entries.append((environ[API_KEY_ENV], API_KEY_ENV))
    return parse_api_keys([spec for spec, _ in entries], [where for _, where in entries])


def parse_metrics_keys(specs: list[str]) -> dict[bytes, str]:
    """--metrics-api-key values -> {sha256(KEY): "metrics"} (the whole value is the key); raises ValueError
    on an empty one."""
    if not all(specs):
        raise ValueError("--metrics-api-key must not be empty")
    return {_digest(key): "metrics" for key in specs}


def load_metrics_keys(flags: list[str], files: list[str], environ: dict) -> dict[bytes, str]:
    """The keys of --metrics-api-key, each --metrics-api-key-file and SPARSEKV_METRICS_API_KEY (the whole
    value is the key): a key kept off the command line, as the API and admin keys may be."""
    keys = list(flags)
    for path in files:
        keys += [line for line, _ in read_api_key_file(path, "--metrics-api-key-file")]
    if environ.get(METRICS_API_KEY_ENV):
        keys.append(environ[METRICS_API_KEY_ENV])
    return parse_metrics_keys(keys)


def load_admin_keys(flags: list[str], files: list[str], environ: dict) -> dict[bytes, str]:
    """The admin keys of --admin-api-key, each --admin-api-key-file and SPARSEKV_ADMIN_API_KEY, as
    {sha256(KEY): "admin"} (the whole value is the key); ValueError on an empty one."""
    keys = list(flags)
    for path in files:
        keys += [line for line, _ in read_api_key_file(path, "--admin-api-key-file")]
    if environ.get(ADMIN_API_KEY_ENV):
        keys.append(environ[ADMIN_API_KEY_ENV])
    if not all(keys):
        raise ValueError("--admin-api-key must not be empty")
    return {_digest(key): "admin" for key in keys}


def tenant_for(keys: dict[bytes, str], authorization: str | None) -> str | None:
    """The tenant of a `Bearer KEY` header, or None if it matches no key."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    digest = _digest(token.strip())
    found = None
    for known, tenant in keys.items():  # no early exit: the time taken does not depend on which key matched
        if secrets.compare_digest(known, digest):
            found = tenant
    return found


def several_authorizations(scope) -> bool:
    """More than one Authorization header: a singleton field (RFC 9110), where taking either one would
    let a proxy and the server disagree on the key."""
    return sum(name == b"authorization" for name, _ in scope["headers"]) > 1


async def reject_several_authorizations(send) -> None:
    await _reject(send, 400, "BadRequestError", "more than one Authorization header")


class OneAuthorization:
    """Plain ASGI: a request with several Authorization headers is a 400 (`sparsekv router`, which
    forwards the header to its workers and hashes it for affinity, must not pick one)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and several_authorizations(scope):
            return await reject_several_authorizations(send)
        return await self.app(scope, receive, send)


class AuthMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which interferes with streaming and disconnects)."""

    def __init__(self, app, keys: dict[bytes, str], admin_keys: dict[bytes, str] | None = None):
        self.app, self.keys, self.admin_keys = app, keys, admin_keys or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if several_authorizations(scope):
            return await reject_several_authorizations(send)
        if scope["path"] in ADMIN_PATHS and scope["method"] != "OPTIONS":
            return await self._admin(scope, receive, send)
        if not self.keys:
            scope[TENANT_SCOPE_KEY] = DEFAULT_TENANT
            return await self.app(scope, receive, send)
        if scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        tenant = tenant_for(self.keys, headers.get(b"authorization", b"").decode("latin-1"))
        if tenant is None:
            return await _reject(send, 401, "AuthenticationError",
                                 "missing or invalid API key (send 'Authorization: Bearer KEY')")
        scope[TENANT_SCOPE_KEY] = tenant
        return await self.app(scope, receive, send)


    async def _admin(self, scope, receive, send):
        if not self.admin_keys:
            return await _reject(send, 403, "PermissionDeniedError",
                                 "admin endpoints are off: start the server with --admin-api-key")
        headers = dict(scope["headers"])
        if tenant_for(self.admin_keys, headers.get(b"authorization", b"").decode("latin-1")) is None:
            return await _reject(send, 401, "AuthenticationError", "this endpoint needs an admin API key")
        scope[TENANT_SCOPE_KEY] = DEFAULT_TENANT
        return await self.app(scope, receive, send)


async def _reject(send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
