"""Turn a validated OpenAI request into engine input: prompt token ids and SamplingParams.

Adapter over vLLM's protocol models (vllm 0.32.0): ``to_sampling_params`` applies the
request's fields over the model's generation-config defaults, as vLLM's OpenAI server does.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from workers.control_params import PruningControl, SamplingControl
from workers.errors import InvalidRequest
from workers.sampling import _GREEDY_EPS


def _message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as chat templates take it: text content, and the tool-call fields of tool-using turns (an
    assistant's ``tool_calls`` with their arguments as objects, as vLLM hands them to templates; a tool
    result's ``tool_call_id`` and ``name``)."""
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest("only text content parts are supported", f"messages[{index}].content")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequest("message content must be a string", f"messages[{index}].content")
    out: dict[str, Any] = {"role": str(message.get("role", "user")), "content": content}
    calls = message.get("tool_calls")
    if calls:
        # A message of a role vLLM does not type (e.g. "developer") reaches here unvalidated
        if not isinstance(calls, (list, tuple)) or not all(isinstance(call, Mapping) for call in calls):
            raise InvalidRequest("tool_calls must be a list of tool call objects", f"messages[{index}].tool_calls")
        out["tool_calls"] = [_tool_call(dict(call), f"messages[{index}].tool_calls[{i}]") for i, call in enumerate(calls)]
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            out[name] = str(message[name])
    return out


def _tool_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    function = call.get("function") or {}
    if not isinstance(function, Mapping):
        raise InvalidRequest("a tool call's function must be an object", f"{param}.function")
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise InvalidRequest("tool call arguments must be a JSON object", f"{param}.function.arguments") from None
    return {"id": call.get("id"), "type": call.get("type", "function"),
            "function": {"name": function.get("name"), "arguments": arguments}}


def _template_kwargs(request: Any, tokenizer: Any) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` the template accepts, as vLLM's server filters them
    (``tokenize`` and ``chat_template`` are refused: they would change what the call returns)."""
    from vllm.renderers.hf import resolve_chat_template_kwargs

    kwargs = dict(request.chat_template_kwargs or {})
    if not kwargs:
        return kwargs
    try:
        return resolve_chat_template_kwargs(tokenizer, tokenizer.get_chat_template(None), kwargs)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "chat_template_kwargs") from None


def encode(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as exc:  # e.g. a lone surrogate ("\ud800") in the text
        raise InvalidRequest(f"the text cannot be tokenized: {exc}", param) from None


def render_chat(request: Any, tokenizer: Any) -> str:
    """The chat request's messages through the model's own chat template, as text."""
    messages = [_message(dict(m), i) for i, m in enumerate(request.messages)]
    kwargs = _template_kwargs(request, tokenizer)
    tools = getattr(request, "tools", None)
    if tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if getattr(request, "documents", None):
        kwargs["documents"] = request.documents
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, tokenize=False,
            continue_final_message=bool(request.continue_final_message), **kwargs
        )
    except Exception as exc:  # the template's own error (jinja raise_exception, a bad kwarg's type)
        raise InvalidRequest(f"the chat template could not render these messages: {exc}", "messages") from None


def prompt_token_ids(kind: str, request: Any, tokenizer: Any, max_model_len: int | None = None) -> list[int]:
    """The prompt the engine gets: the chat rendered, or the text encoded (``add_special_tokens`` as the request
    says: vLLM's defaults are off for chat, whose template adds them, and on for completions), then cut to
    ``truncate_prompt_tokens`` (-1: the context less one token) from ``truncation_side``, as vLLM does."""
    if kind == "chat":
        ids = encode(tokenizer, render_chat(request, tokenizer), request.add_special_tokens, "messages")
    else:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(tokenizer, prompt, request.add_special_tokens, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = len(tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise InvalidRequest(f"token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
        else:
            raise InvalidRequest("prompt must be one non-empty string or one list of token ids", "prompt")
    keep = request.truncate_prompt_tokens
    if keep is not None and keep < 0 and max_model_len is not None:
        keep = max_model_len - 1
    if keep is None or keep < 0 or keep >= len(ids):
        return ids
    side = request.truncation_side or getattr(tokenizer, "truncation_side", "left")
    return ids[len(ids) - keep:] if side == "left" else ids[:keep]


def _constrained_to_tool_calls(request: Any) -> Any:
    """With ``tool_choice`` "required" or a named function, the output is constrained to vLLM's JSON for tool
    calls (deployments/tool_calls.py reads it back). The grammar masks the logits before our logits processor
    sees them, so entropy telemetry and the temperature law act on the constrained distribution."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    try:
        schema = get_json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "tool_choice") from None
    if schema is None:  # "auto" or "none": the tools are only in the prompt
        return request
    return request.model_copy(update={"structured_outputs": StructuredOutputsParams(json=schema), "response_format": None})


def sampling_params(
    kind: str,
    request: Any,
    prompt_len: int,
    max_model_len: int,
    generation_defaults: dict[str, Any],
    control: SamplingControl,
    key: str,
    pruning: PruningControl | None = None,
) -> Any:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    room = max_model_len - prompt_len
    param = "messages" if kind == "chat" else "prompt"
    if room <= 0:
        raise InvalidRequest(
            f"the prompt is {prompt_len} tokens; this model's context is {max_model_len} tokens", param
        )
    requested = request.max_completion_tokens if kind == "chat" else None
    requested = requested if requested is not None else request.max_tokens
    if requested is not None and requested > room:
        raise InvalidRequest(
            f"max_tokens={requested} with a {prompt_len}-token prompt exceeds the {max_model_len}-token context",
            "max_tokens",
        )
    if kind == "chat" and request.tools:
        request = _constrained_to_tool_calls(request)
    try:
        params = request.to_sampling_params(requested if requested is not None else room, generation_defaults)
    except (ValueError, VLLMValidationError) as exc:
        raise InvalidRequest(str(exc), getattr(exc, "parameter", None)) from None
    params.output_kind = RequestOutputKind.DELTA
    requested_temperature = params.temperature
    if control.enabled and requested_temperature >= _GREEDY_EPS:
        params.temperature = 1.0  # the logits processor applies the whole controlled temperature
    args = control.request_args(key, requested_temperature, pruning)
    params.extra_args = args.into(params.extra_args)
    if pruning is not None and args.pruning is not None:
        if pruning.wants_surprisal(prompt_len + params.max_tokens):
            # Block information content needs token surprisal: the logprob of each sampled token, which
            # vLLM returns with any logprobs the client asked for (workers.engine feeds them to the pruner).
            # Prompt logprobs only when the client asks for them (docs/pruning.md).
            if params.logprobs is None:
                params.logprobs = 0
    return params
