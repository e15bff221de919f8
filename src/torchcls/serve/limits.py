"""Guards in front of the app (pure ASGI, so they act before any body is read): size limit, bearer token."""

from __future__ import annotations

from collections.abc import Callable

import orjson


async def send_error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps({"error": message})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body above `max_bytes`: at once from Content-Length, or as soon as a chunked body passes it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body above the server's limit of {self.max_bytes:,} bytes (--max-body-mb)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, 413, message)
        received, started = 0, False

        async def counting_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return msg

        async def tracking_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await send_error(send, 413, message)


class AuthMiddleware:
    """401 unless `Authorization: Bearer <token>` matches (compared in constant time)."""

    def __init__(self, app, token: str, public: frozenset[str], compare: Callable[[bytes, bytes], bool]):
        self.app, self.expected, self.public, self.compare = app, f"Bearer {token}".encode(), public, compare

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not self.compare(given, self.expected):
            return await send_error(send, 401, "missing or wrong bearer token: send 'Authorization: Bearer TOKEN'",
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)
