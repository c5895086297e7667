"""Graceful drain of the HTTP ingress: once draining, new requests get 503 with ``Retry-After`` and an
OpenAI error object, while the ones already in flight (streams included) run to their end. The same
middleware counts every response by status code (``entropic_http_responses_total``: what the error-rate
alerts read).

A pure ASGI middleware, so a request counts as in flight until its response body has been sent in full:
a streaming response ends with its last SSE line, not when its handler returns. ``/metrics`` is still
answered while draining, so the last scrape sees the drain. One ingress replica per process, hence
one state per process.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from deployments.protocol import error_body
from deployments.routing_view import HTTP_RESPONSES
from workers.aio import wait_for

RETRY_AFTER_S = 5
_ANSWERED_WHILE_DRAINING = ("/metrics",)
_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                     "/metrics"})


class DrainState:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._idle is None:  # created on the replica's event loop, where requests run
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def enter(self) -> None:
        self.in_flight += 1
        self._event().clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._event().set()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests from now on; wait up to ``timeout_s`` for those in flight; how many are left."""
        self.draining = True
        try:
            await wait_for(self._event().wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.in_flight


DRAIN = DrainState()


class DrainMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path")
        route = path if path in _ROUTES else "other"  # bounded label values, whatever clients send

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                HTTP_RESPONSES.labels(str(message["status"]), route).inc()
            await send(message)

        if DRAIN.draining and path not in _ANSWERED_WHILE_DRAINING:
            body = json.dumps(error_body("the server is shutting down; retry shortly", None, 503,
                                         "ServiceUnavailableError")).encode()
            await counted({"type": "http.response.start", "status": 503,
                           "headers": [(b"content-type", b"application/json"),
                                       (b"retry-after", str(RETRY_AFTER_S).encode()),
                                       (b"content-length", str(len(body)).encode())]})
            await counted({"type": "http.response.body", "body": body})
            return
        DRAIN.enter()
        try:
            await self.app(scope, receive, counted)
        finally:
            DRAIN.leave()
