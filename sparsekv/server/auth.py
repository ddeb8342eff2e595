"""API keys and tenants.

`--api-key KEY` or `--api-key KEY:TENANT`, repeatable. Each key maps to a tenant, and the tenant goes
on every engine request: the prefix cache must never share entries across tenants. A key given
without a tenant gets its own tenant, `key-<first 8 hex of sha256(key)>`, so two such keys never share
and the key itself never appears in logs or metrics. Without `--api-key` every request is tenant
`default`.

Keys are kept as SHA-256 digests and compared with `secrets.compare_digest` against all of them, as
vLLM does. /health and /metrics stay public, as in vLLM and SGLang (/metrics' per-tenant series
only with a --metrics-api-key: app.metrics). Two Authorization headers are a 400 on any path.
"""
from __future__ import annotations

import hashlib
import json
import secrets

PUBLIC_PATHS = ("/health", "/metrics", "/ping", "/version")
DEFAULT_TENANT = "default"
TENANT_SCOPE_KEY = "sparsekv.tenant"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_api_keys(specs: list[str]) -> dict[bytes, str]:
    """['KEY', 'KEY:TENANT', ...] -> {sha256(KEY): tenant}; raises ValueError on an empty key or tenant."""
    keys = {}
    for spec in specs:
        key, sep, tenant = spec.partition(":")
        if not key or (sep and not tenant):
            raise ValueError(f"--api-key must be KEY or KEY:TENANT with both parts non-empty, got {spec!r}")
        digest = _digest(key)
        keys[digest] = tenant if sep else "key-" + digest.hex()[:8]
    return keys


def parse_metrics_keys(specs: list[str]) -> dict[bytes, str]:
    """--metrics-api-key values -> {sha256(KEY): "metrics"} (the whole value is the key); raises ValueError
    on an empty one."""
    if not all(specs):
        raise ValueError("--metrics-api-key must not be empty")
    return {_digest(key): "metrics" for key in specs}


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


class AuthMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which interferes with streaming and disconnects)."""

    def __init__(self, app, keys: dict[bytes, str]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
            # a singleton field (RFC 9110): taking either one would let a proxy and the server disagree on the key
            return await _reject(send, 400, "BadRequestError", "more than one Authorization header")
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


async def _reject(send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
