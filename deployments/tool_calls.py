"""Tool calls out of constrained output, for ``tool_choice: "required"`` or a named function.

The replica constrains generation to the JSON that vLLM's tool-call path uses for any model (workers/prompts.py:
the named function's arguments, or a list of ``{"name", "parameters"}``), so the text is parseable by
construction; this module turns it into OpenAI ``tool_calls`` as vLLM's server does (vllm 0.32.0), finish
reason included: ``tool_calls`` for "required", ``stop`` for a named function. ``tool_choice: "auto"`` needs a
parser for the model family's own call format; none is configured here, so, as ``vllm serve`` without
``--enable-auto-tool-choice``, the tools reach the chat template and the reply comes back as text.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter, ValidationError
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

_CALLS = TypeAdapter(list[FunctionDefinition])


class ToolCalls:
    """One choice's tool calls, from its text."""

    def __init__(self, named: str | None) -> None:
        self.named = named  # None: "required", a list of calls
        self._text: list[str] = []
        self._started = False

    @classmethod
    def of(cls, kind: str, request: Any) -> ToolCalls | None:
        """For a chat request whose output is constrained to tool calls, else None."""
        if kind != "chat" or not request.tools:
            return None
        choice = request.tool_choice
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            return cls(choice.function.name)
        return cls(None) if choice == "required" else None

    def calls(self, text: str) -> list[ToolCall]:
        if self.named is not None:
            return [ToolCall(function=FunctionCall(name=self.named, arguments=text))] if text.strip() else []
        try:
            parsed = _CALLS.validate_json(text or "")
        except ValidationError:  # cut off by max_tokens: no complete call
            return []
        return [ToolCall(function=FunctionCall(name=c.name, arguments=json.dumps(c.parameters, ensure_ascii=False)))
                for c in parsed]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if self.named is None and called and reason == "stop" else reason

    def stream(self, piece: str, finished: bool) -> DeltaMessage:
        """The chunk's delta: a named call streams its arguments as they come; "required" sends its calls whole
        when the output ends (a partial list is not yet calls)."""
        if self.named is not None:
            if not piece:
                return DeltaMessage()
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))
            if not self._started:
                first = ToolCall(function=FunctionCall(name=self.named, arguments=""))
                call = DeltaToolCall(index=0, id=first.id, type="function",
                                     function=DeltaFunctionCall(name=self.named, arguments=piece))
                self._started = True
            return DeltaMessage(tool_calls=[call])
        self._text.append(piece)
        if not finished:
            return DeltaMessage()
        calls = self.calls("".join(self._text))
        self._started = bool(calls)
        return DeltaMessage(tool_calls=[
            DeltaToolCall(index=i, id=c.id, type="function",
                          function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
            for i, c in enumerate(calls)])

    @property
    def called(self) -> bool:
        """Whether a streamed choice has sent a call."""
        return self._started
