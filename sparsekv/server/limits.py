"""Request-size bounds that hold before any handler runs, and giving memory back after large requests.

`BodyLimitMiddleware` reads the whole body (the routes need all of it anyway) and answers 413 in the
OpenAI envelope as soon as it is over `--max-request-body-bytes`: at once from Content-Length, or
while counting a chunked body that has none. The handler then sees the body already read, and later
`receive()` calls (the disconnect watch) go to the connection as before.

A large request leaves freed memory in glibc's arenas (the tokenizer's buffers are allocated on its
worker threads), where RSS keeps it. `release_memory()` asks glibc to hand the free pages back
(`malloc_trim`); the middleware calls it, off the event loop, after any request whose body was large.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import logging

from .errors import error_body

log = logging.getLogger("sparsekv.server")
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 128  # a completion's batch of prompts: as many as `n` may ask for
TRIM_AFTER_BYTES = 1 << 20  # smaller bodies leave too little behind to be worth a trim


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Plain ASGI: bounds the body of every HTTP request, then trims memory after large ones."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if _declared_length(scope) > self.max_bytes:
            return await self._too_large(send)
        try:
            body = await _read_body(receive, self.max_bytes)
        except BodyTooLarge:
            return await self._too_large(send)
        size = len(body)
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            del body
            if size >= TRIM_AFTER_BYTES:
                await asyncio.get_running_loop().run_in_executor(None, release_memory)

    async def _too_large(self, send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        body = json.dumps(error_body(413, message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _declared_length(scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP parser refuses these first; count the body instead
                return 0
    return 0


async def _read_body(receive, max_bytes: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as more than max_bytes have arrived."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left; the handler sees an empty body
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that hands out the body read already, once, then the connection's own messages."""
    pending = [body]

    async def replay():
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()
    return replay


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_memory() -> None:
    """Return freed heap pages of every glibc arena to the OS (a no-op without glibc). ctypes drops
    the GIL for the call, so other threads run meanwhile."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
