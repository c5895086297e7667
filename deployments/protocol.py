"""OpenAI request/response models: vLLM's protocol models plus the ``entropic`` extension.

Requests reuse vLLM's pydantic models (vllm 0.32.0 module layout) so every OpenAI field
vLLM accepts is accepted here. ``EntropicOptions`` is derived from ``SamplingControl``
with every field optional: one definition of the fields and their ranges, two uses.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from vllm.entrypoints.generate.base.protocol import DeltaMessage  # noqa: F401
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
from vllm.entrypoints.serve.engine.protocol import (  # noqa: F401
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from vllm.entrypoints.serve.tokenize.protocol import (  # noqa: F401
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm.exceptions import VLLMValidationError

from workers.control_params import EpicControl, PruningControl, SamplingControl
from workers.errors import InvalidRequest


def _optional(field: Any) -> Any:
    constrained = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return (constrained | None, None)


PruningOptions = create_model(
    "PruningOptions",
    __config__=ConfigDict(extra="forbid"),
    **{name: _optional(field) for name, field in PruningControl.model_fields.items()},
)

EntropicOptions = create_model(
    "EntropicOptions",
    __config__=ConfigDict(extra="forbid"),
    pruning=(PruningOptions | None, None),
    **{name: _optional(field) for name, field in SamplingControl.model_fields.items()},
    **{name: _optional(field) for name, field in EpicControl.model_fields.items()},
)


class EntropicChatCompletionRequest(ChatCompletionRequest):
    entropic: EntropicOptions | None = None


class EntropicCompletionRequest(CompletionRequest):
    entropic: EntropicOptions | None = None


REQUEST_MODELS: dict[str, Any] = {"chat": EntropicChatCompletionRequest, "completion": EntropicCompletionRequest}


def _absent(value: Any) -> bool:
    return value is None


class EpicTokenTelemetry(BaseModel):
    """How one token of an EPIC request was drawn (``workers.engine.EpicStep``)."""

    lookahead_entropy: float | None  # nats over the horizon, where the chosen token's lookahead was estimated
    candidates_evaluated: int
    rollout_tokens: int
    exact: bool


class EntropicTelemetry(BaseModel):
    """The ``entropic`` object of every choice: per generated token (of this stream chunk, or of the whole
    choice) its entropy in nats and the temperature it was sampled at (null where not finite), entropic time
    τ so far, and for the whole choice the mean and variance of the entropy; ``kv_blocks`` (kept, total) per
    decode step where KV pruning ran. Absent fields are left out."""

    entropy: list[float | None]
    temperature: list[float | None]
    entropic_time: float
    mean_entropy: float | None = Field(None, exclude_if=_absent)
    entropy_variance: float | None = Field(None, exclude_if=_absent)
    kv_blocks: list[list[int]] | None = Field(None, exclude_if=_absent)
    epic: list[EpicTokenTelemetry] | None = Field(None, exclude_if=_absent)


class EntropicChatChoice(ChatCompletionResponseChoice):
    entropic: EntropicTelemetry | None = None


class EntropicChatResponse(ChatCompletionResponse):
    choices: list[EntropicChatChoice]


class EntropicChatStreamChoice(ChatCompletionResponseStreamChoice):
    entropic: EntropicTelemetry | None = None


class EntropicChatStreamResponse(ChatCompletionStreamResponse):
    choices: list[EntropicChatStreamChoice]


class EntropicCompletionChoice(CompletionResponseChoice):
    entropic: EntropicTelemetry | None = None


class EntropicCompletionResponse(CompletionResponse):
    choices: list[EntropicCompletionChoice]


class EntropicCompletionStreamChoice(CompletionResponseStreamChoice):
    entropic: EntropicTelemetry | None = None


class EntropicCompletionStreamResponse(CompletionStreamResponse):
    choices: list[EntropicCompletionStreamChoice]

_UNSUPPORTED = {
    "use_beam_search": "beam search is not supported",
    "suffix": "suffix is not supported",
    "logprob_token_ids": "logprob_token_ids are not supported: logprobs name the top tokens",
    "prompt_embeds": "this server serves text models only",
    "mm_processor_kwargs": "this server serves text models only",
    "media_io_kwargs": "this server serves text models only",
    "return_mm_kwargs": "this server serves text models only",
    "return_token_offsets": "return_token_offsets is offered by vLLM's render endpoints only",
    "return_prompt_text": "return_prompt_text is not supported",
    "reasoning_effort": "reasoning_effort needs a reasoning parser, and this server runs none",
    "session_id": "session_id is not supported",
    # vLLM's server refuses these unless started with --trust-request-chat-template /
    # --logits-processors; this server renders every chat with the model's own template and runs
    # only its own processors, and says so instead of ignoring them
    "chat_template": "a chat template per request is not accepted: the model's own template renders every chat",
    "logits_processors": "logits processors per request are not accepted",
}


# Fields whose other values need what this server does not run (vLLM refuses a nonzero priority, too, unless
# started with priority scheduling)
_ONLY_DEFAULT = (
    ("priority", 0, "this server orders requests by its own priority π (docs/scheduling.md); a client priority "
                    "is not accepted"),
    ("length_penalty", 1.0, "length_penalty applies to beam search, which is not supported"),
    ("include_reasoning", True, "include_reasoning needs a reasoning parser, and this server runs none"),
    ("mm_payload", "tensors", "this server serves text models only"),
)


class ModelNotFound(InvalidRequest):
    """A request names a model this server does not serve: 404, as ``vllm serve`` answers."""

    def __init__(self, model: str, served_model: str) -> None:
        super().__init__(f"The model `{model}` does not exist. Valid aliases: {served_model}.", "model")


def _loc(error: dict[str, Any]) -> str | None:
    """The field's path as a client wrote it (``messages[0].content``), without pydantic's model and
    union-branch tags (``ChatCompletionRequest``, ``list[constrained-int]``)."""
    path = ""
    for part in error.get("loc", ()):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and not part[:1].isupper() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _most_telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a union's errors, the one from the branch the input's type matched (a too-long list, not
    "should be a valid string"); if every branch is a type mismatch, the deepest."""
    fitting = [e for e in errors if not e["type"].endswith("_type")]
    return fitting[0] if fitting else max(errors, key=lambda e: len(e.get("loc", ())))


MAX_JSON_DEPTH = 64


def check_json_text(body: Any) -> None:
    """Refuse what no field may hold: nesting deeper than MAX_JSON_DEPTH, and strings that are not
    Unicode text (JSON can spell a lone surrogate, ``"\\ud800"``; tokenizers and detokenizers cannot take it)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"the request is nested more than {MAX_JSON_DEPTH} levels deep", path or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest("the text is not valid Unicode (it holds a lone surrogate)", path or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                child = f"{path}.{k}" if path else str(k)
                stack.extend(((k, path, depth + 1), (v, child, depth + 1)))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def parse_request(kind: str, body: Any, served_model: str) -> Any:
    """Validate a decoded JSON body; raises InvalidRequest naming the offending field."""
    request = _validate(REQUEST_MODELS[kind], body)
    if request.model is not None and request.model != served_model:
        raise ModelNotFound(request.model, served_model)
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and value <= 0 and not (value == 0 and kind == "completion" and request.echo):
            # max_tokens 0 with echo scores the prompt alone (lm-eval's loglikelihood requests), as in vLLM
            raise InvalidRequest(f"{field} must be at least 1, got {value}", field)
    if request.temperature is not None and request.temperature < 0:
        raise InvalidRequest(f"temperature must be non-negative, got {request.temperature}", "temperature")
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got {request.n}", "n")
    for field, message in _UNSUPPORTED.items():
        if getattr(request, field, None):
            raise InvalidRequest(message, field)
    for field, default, message in _ONLY_DEFAULT:
        if getattr(request, field, default) != default:
            raise InvalidRequest(message, field)
    if kind == "chat":
        if not request.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        _materialize(request.messages)
    elif request.prompt in (None, "", []) or (isinstance(request.prompt, list) and any(
            q in ("", []) for q in request.prompt if not isinstance(q, int))):
        raise InvalidRequest("prompt must not be empty", "prompt")
    elif len(prompts(request)) * (request.n or 1) > MAX_CHOICES:
        raise InvalidRequest(f"prompts times n must be at most {MAX_CHOICES}", "prompt")
    return request


def _materialize(messages: list[Any]) -> None:
    """Turn the lazily validated iterables of OpenAI's message types (a developer message's content parts, for
    one) into lists: validated now, so a bad part is a 400 here, and picklable, so the request can travel to
    a worker replica (a pydantic ValidatorIterator cannot)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for key, value in message.items():
            if isinstance(value, (str, bytes, list, dict)) or not hasattr(value, "__iter__"):
                continue
            try:
                message[key] = list(value)
            except ValidationError as exc:
                error = _most_telling([dict(e) for e in exc.errors()])
                raise InvalidRequest(f"messages[{i}].{key}: {error['msg']}", f"messages[{i}].{key}") from None


def _validate(model: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_json_text(body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = _most_telling([dict(e) for e in exc.errors()])
        raise InvalidRequest(f"{_loc(error)}: {error['msg']}", _loc(error)) from None
    except (ValueError, VLLMValidationError) as exc:
        raise InvalidRequest(str(exc), getattr(exc, "parameter", None)) from None


_TOKENIZE_UNSUPPORTED = {
    "chat_template": _UNSUPPORTED["chat_template"],
    "mm_processor_kwargs": "this server serves text models only",
    "media_io_kwargs": "this server serves text models only",
}


def parse_tokenize(body: Any, served_model: str) -> Any:
    """A /tokenize body: ``TokenizeChatRequest`` when it has ``messages``, else ``TokenizeCompletionRequest``."""
    chat = isinstance(body, dict) and "messages" in body
    request = _validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    if request.model is not None and request.model != served_model:
        raise ModelNotFound(request.model, served_model)
    for field, message in _TOKENIZE_UNSUPPORTED.items():
        if getattr(request, field, None):
            raise InvalidRequest(message, field)
    if chat:
        _materialize(request.messages)
    return request


def parse_detokenize(body: Any, served_model: str) -> Any:
    request = _validate(DetokenizeRequest, body)
    if request.model is not None and request.model != served_model:
        raise ModelNotFound(request.model, served_model)
    return request


MAX_CHOICES = 64


def prompts(request: Any) -> list[Any]:
    """A completion request's prompts, each a string or a list of token ids (a batch, as vLLM takes one)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


def choice_requests(kind: str, request: Any) -> list[Any]:
    """One request per choice, in vLLM's order (prompt by prompt, then ``n`` choices each): each has one prompt
    and n = 1, choice i of a prompt seeded ``seed + i`` when a seed is given (else each draws its own), so every
    choice has its own telemetry and temperature-law state."""
    n = request.n or 1
    batch = prompts(request) if kind == "completion" else [None]
    if n == 1 and len(batch) == 1:
        return [request]
    return [request.model_copy(update={"n": 1, "seed": None if request.seed is None else request.seed + i,
                                       **({"prompt": prompt} if prompt is not None else {})})
            for prompt in batch for i in range(n)]


def overrides(request: Any) -> dict[str, Any] | None:
    """The request's ``entropic`` object as overrides: sampling fields at the top, ``pruning`` nested."""
    options = request.entropic
    return None if options is None else options.model_dump(exclude_none=True)


_CHARS_PER_TOKEN = 4  # BPE vocabularies on English text; the dispatch queue needs an estimate, not a count


def prompt_estimate(kind: str, request: Any) -> tuple[int, int | None]:
    """(prompt tokens, max_tokens) as the ingress can tell without a tokenizer: token-id prompts exactly,
    text at ~4 characters per token plus a few per chat turn for the template."""
    if kind == "chat":
        chars = sum(len(str(dict(m).get("content") or "")) + 4 * _CHARS_PER_TOKEN for m in request.messages)
        limit = request.max_completion_tokens or request.max_tokens
    else:
        prompt = request.prompt[0] if isinstance(request.prompt, list) and len(request.prompt) == 1 \
            and not isinstance(request.prompt[0], int) else request.prompt
        if isinstance(prompt, list):
            return len(prompt), request.max_tokens
        chars, limit = len(str(prompt)), request.max_tokens
    return max(1, chars // _CHARS_PER_TOKEN), limit


def error_body(message: str, param: str | None, code: int = 400, kind: str = "BadRequestError") -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()
