"""Errors a request can fail with that are the client's fault (HTTP 400)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """Raised anywhere on the request path; the ingress answers 400 with ``param``.

    Arguments go to ``Exception.args`` so the error survives pickling across Ray.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message
