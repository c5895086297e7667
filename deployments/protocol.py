"""OpenAI request/response models: vLLM's protocol models plus the ``entropic`` extension.

Requests reuse vLLM's pydantic models (vllm 0.32.0 module layout) so every OpenAI field
vLLM accepts is accepted here. ``EntropicOptions`` is derived from ``SamplingControl``
with every field optional: one definition of the fields and their ranges, two uses.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import ConfigDict, ValidationError, create_model
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: F401 (re-exported)
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (  # noqa: F401
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.generate.base.protocol import DeltaMessage  # noqa: F401
from vllm.entrypoints.serve.engine.protocol import (  # noqa: F401
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)

from vllm.exceptions import VLLMValidationError

from workers.control_params import PruningControl, SamplingControl
from workers.errors import InvalidRequest

def _optional(field: Any) -> Any:
    constrained = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return (Optional[constrained], None)


PruningOptions = create_model(
    "PruningOptions",
    __config__=ConfigDict(extra="forbid"),
    **{name: _optional(field) for name, field in PruningControl.model_fields.items()},
)

EntropicOptions = create_model(
    "EntropicOptions",
    __config__=ConfigDict(extra="forbid"),
    pruning=(Optional[PruningOptions], None),  # type: ignore[valid-type]
    **{name: _optional(field) for name, field in SamplingControl.model_fields.items()},
)


class EntropicChatCompletionRequest(ChatCompletionRequest):
    entropic: Optional[EntropicOptions] = None  # type: ignore[valid-type]


class EntropicCompletionRequest(CompletionRequest):
    entropic: Optional[EntropicOptions] = None  # type: ignore[valid-type]


REQUEST_MODELS = {"chat": EntropicChatCompletionRequest, "completion": EntropicCompletionRequest}

_UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "use_beam_search": "beam search is not supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "logprobs": "logprobs are not supported yet",
    "prompt_logprobs": "prompt_logprobs are not supported yet",
}


def _loc(error: dict[str, Any]) -> str:
    parts = [str(p) for p in error.get("loc", ()) if not (isinstance(p, str) and p[:1].isupper())]
    return ".".join(parts) or None  # type: ignore[return-value]


def parse_request(kind: str, body: Any, served_model: str) -> Any:
    """Validate a decoded JSON body; raises InvalidRequest naming the offending field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        request = REQUEST_MODELS[kind].model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequest(f"{_loc(first)}: {first['msg']}", _loc(first)) from None
    except (ValueError, VLLMValidationError) as exc:  # vLLM's own model validators
        raise InvalidRequest(str(exc), getattr(exc, "parameter", None)) from None
    if request.model is not None and request.model != served_model:
        raise InvalidRequest(f"the model `{request.model}` does not exist; this server serves `{served_model}`", "model")
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and value <= 0:
            raise InvalidRequest(f"{field} must be at least 1, got {value}", field)
    if request.temperature is not None and request.temperature < 0:
        raise InvalidRequest(f"temperature must be non-negative, got {request.temperature}", "temperature")
    if request.n not in (None, 1):
        raise InvalidRequest("only n=1 is supported", "n")
    for field, message in _UNSUPPORTED.items():
        if getattr(request, field, None):
            raise InvalidRequest(message, field)
    if kind == "chat":
        if not request.messages:
            raise InvalidRequest("messages must not be empty", "messages")
    elif request.prompt in (None, "", []):
        raise InvalidRequest("prompt must not be empty", "prompt")
    elif isinstance(request.prompt, list) and len(request.prompt) > 1 and not isinstance(request.prompt[0], int):
        raise InvalidRequest("one prompt per request is supported", "prompt")
    return request


def overrides(request: Any) -> dict[str, Any] | None:
    """The request's ``entropic`` object as overrides: sampling fields at the top, ``pruning`` nested."""
    options = request.entropic
    return None if options is None else options.model_dump(exclude_none=True)


def error_body(message: str, param: str | None, code: int = 400, kind: str = "BadRequestError") -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()
