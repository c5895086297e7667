"""How a request can fail, by whose fault: each maps to one HTTP answer at the ingress.

Arguments go to ``Exception.args`` so the errors survive pickling across Ray (a replica's
exception reaches the ingress wrapped in a ``RayTaskError`` that still subclasses it).
"""
from __future__ import annotations


class RequestError(Exception):
    """An expected way for one request to end without its output (those below); the ingress answers each its own way."""


class InvalidRequest(ValueError, RequestError):
    """The client's mistake, found anywhere on the request path: HTTP 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


class ReplicaUnavailable(RuntimeError, RequestError):
    """This replica cannot take the request (its engine has stopped, or it is draining).

    Nothing was generated, so the ingress may send the request elsewhere; if it cannot, HTTP 503
    with ``Retry-After``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RequestFailed(RuntimeError, RequestError):
    """One request failed inside the engine through no fault of the client; the engine goes on.

    The message is safe to show a client; the cause is logged on the replica with the request key.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RequestMoved(RequestError):
    """The controller moved this request, still waiting with nothing computed, to another replica
    (controller.laws.migration): the ingress sends it to ``replica_id`` under the same ``key``. Never a client's
    answer."""

    def __init__(self, key: str, replica_id: str) -> None:
        super().__init__(key, replica_id)
        self.key = key
        self.replica_id = replica_id

    def __str__(self) -> str:
        return f"request {self.key} moved to replica {self.replica_id}"
