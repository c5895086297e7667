"""Who may call the HTTP API: bearer API keys and CORS, as ``vllm serve`` checks them.

One pure ASGI middleware on the ingress's app, configured by the ingress replica when it starts
(``POLICY.configure``): CORS outermost (a browser's preflight is answered before any key is asked
for, as vLLM's authentication skips OPTIONS), then the key check on ``/v1/*`` and ``/debug/*``.
A wrong or missing key gets 401 with an OpenAI error object (vLLM's body is ``{"error":
"Unauthorized"}``; clients read the status either way). Keys are compared as SHA-256 digests in
constant time.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from deployments.config import HttpConfig
from deployments.protocol import error_body

GUARDED_PREFIXES = ("/v1", "/debug")


class HttpPolicy:
    def __init__(self) -> None:
        self.config = HttpConfig()
        self.key_digests: list[bytes] = []
        self.version = 0

    def configure(self, config: HttpConfig) -> None:
        keys = config.api_keys or [k for k in (os.environ.get("VLLM_API_KEY"),) if k]
        self.config = config
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.version += 1

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        found = False
        for key in self.key_digests:  # no early exit: the time taken says nothing about which key is close
            found |= secrets.compare_digest(digest, key)
        return found


POLICY = HttpPolicy()


class _KeyCheck:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        guarded = scope["type"] == "http" and scope.get("method") != "OPTIONS" and POLICY.key_digests \
            and scope["path"].removeprefix(scope.get("root_path", "")).startswith(GUARDED_PREFIXES)
        if guarded and not POLICY.authorized(Headers(scope=scope)):
            body = json.dumps(error_body("Unauthorized: a valid API key is required (Authorization: Bearer ...)",
                                         None, 401, "AuthenticationError")).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class PolicyMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self._stack: Any = None
        self._version = -1

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self._version != POLICY.version:  # built on the first request after the replica configured it
            c = POLICY.config
            self._stack = CORSMiddleware(_KeyCheck(self.app), allow_origins=c.allowed_origins,
                                         allow_methods=c.allowed_methods, allow_headers=c.allowed_headers,
                                         allow_credentials=c.allow_credentials)
            self._version = POLICY.version
        await self._stack(scope, receive, send)
