"""Tools and structured output through the served app (real engines, default model), with the openai client.

The default model has no tool-call format of its own, so what is checked is what works for any model: output
constrained by vLLM's grammar backend to a named function's arguments or to a list of calls, turned back into
OpenAI ``tool_calls``; and ``response_format`` constraining the reply to JSON."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_function_is_called_with_arguments_that_fit_its_schema(client, served_model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=served_model, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                         max_tokens=40, temperature=0)
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert choice.finish_reason == "stop" and not choice.message.content
    # streamed: the name first, the arguments in pieces that add up to the same call
    pieces, names, ids = [], [], set()
    for chunk in client.chat.completions.create(model=served_model, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice=named, max_tokens=40, temperature=0, stream=True):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                assert delta.index == 0
                ids.add(delta.id) if delta.id else None
                names += [delta.function.name] if delta.function.name else []
                pieces.append(delta.function.arguments or "")
    assert names == ["get_weather"] and len(ids) == 1
    assert "".join(pieces) == call.function.arguments


def test_required_tool_choice_returns_calls_and_finish_reason_tool_calls(client, served_model):
    out = client.chat.completions.create(model=served_model, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(client.chat.completions.create(model=served_model, messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                                 temperature=0, stream=True))
    streamed = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [(call.function.name, call.function.arguments)]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_tool_turns_in_the_history_reach_the_template(server, client, served_model):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
                   "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": "sunny and 22 degrees"}]
    ids = httpx.post(f"{server}/tokenize", json={"model": served_model, "messages": history, "tools": [WEATHER]}).json()
    text = httpx.post(f"{server}/detokenize", json={"model": served_model, "tokens": ids["tokens"]}).json()["prompt"]
    assert "sunny and 22 degrees" in text
    out = client.chat.completions.create(model=served_model, messages=history, tools=[WEATHER], max_tokens=24,
                                         temperature=0)
    assert out.choices[0].message.content  # tool_choice "auto" without a parser for the model: a text reply
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served_model, max_tokens=4, messages=[*ASK, {
            "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": "{not json"}}]}])
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_response_format_constrains_the_reply_to_json(client, served_model):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=served_model, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    answer = json.loads(out.choices[0].message.content)
    assert set(answer) == {"capital"} and isinstance(answer["capital"], str)
    # the entropy telemetry is of the constrained distribution: tokens the grammar forces have (near) zero entropy
    assert min(out.choices[0].model_extra["entropic"]["entropy"]) < 1e-3
    loose = client.chat.completions.create(
        model=served_model, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris in JSON."}])
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(loose.choices[0].message.content), dict)
    else:  # cut off by max_tokens: still the start of one JSON object
        assert loose.choices[0].message.content.lstrip().startswith("{")


def test_a_bad_tool_choice_is_a_400(client, served_model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served_model, messages=ASK, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "no_such_tool"}})
    assert err.value.body["param"].startswith("tool_choice")
