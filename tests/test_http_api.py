"""End to end through Ray Serve with the official openai client: real engines, default model."""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import statistics
import time

import httpx
import openai
import pytest

from controller.laws.entropic_time import entropic_time

FACT_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def _entropic(obj) -> dict:
    return obj.model_extra["entropic"]


def _assert_consistent(entropic: dict, n_tokens: int) -> None:
    assert len(entropic["entropy"]) == len(entropic["temperature"]) == n_tokens
    assert all(h is not None and h >= 0 for h in entropic["entropy"])
    assert entropic["entropic_time"] == pytest.approx(entropic_time(entropic["entropy"]), abs=1e-6)


def test_models_and_health(server, client, served_model):
    assert served_model == "SmolLM2-135M-Instruct"
    assert httpx.get(f"{server}/health").status_code == 200


def test_chat_non_stream_greedy_answers_and_carries_telemetry(client, served_model):
    out = client.chat.completions.create(model=served_model, messages=FACT_PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert "paris" in choice.message.content.lower()
    entropic = _entropic(choice)
    _assert_consistent(entropic, out.usage.completion_tokens)
    assert entropic["temperature"] == [0.0] * out.usage.completion_tokens  # greedy: untouched
    hs = entropic["entropy"]
    assert entropic["mean_entropy"] == pytest.approx(sum(hs) / len(hs))
    assert entropic["entropy_variance"] == pytest.approx(sum((h - sum(hs) / len(hs)) ** 2 for h in hs) / len(hs))


def test_chat_stream_with_usage(client, served_model):
    stream = client.chat.completions.create(
        model=served_model, messages=FACT_PROMPT, max_tokens=12, stream=True, seed=1,
        stream_options={"include_usage": True}, extra_body={"entropic": {"target_entropy": 1.5, "eta": 0.4}},
    )
    text, entropy, temperature, taus, usage, finish = "", [], [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            extra = (choice.model_extra or {}).get("entropic")
            if extra:
                entropy += extra["entropy"]
                temperature += extra["temperature"]
                taus.append(extra["entropic_time"])
                assert extra["entropic_time"] == pytest.approx(entropic_time(entropy), abs=1e-6)
    assert usage is not None and usage.completion_tokens == len(entropy) == len(temperature) > 0
    assert finish in ("stop", "length") and text
    assert taus == sorted(taus)  # tau never decreases
    assert temperature[0] == 1.0 and all(0.1 <= t <= 2.0 for t in temperature)


def test_completion_non_stream_and_stream(client, served_model):
    out = client.completions.create(model=served_model, prompt="The capital of France is", max_tokens=6,
                                    temperature=0)
    assert "Paris" in out.choices[0].text
    _assert_consistent(_entropic(out.choices[0]), out.usage.completion_tokens)
    chunks = list(client.completions.create(model=served_model, prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == out.choices[0].text
    entropy = [h for c in chunks for h in _entropic(c.choices[0])["entropy"]]
    assert entropy == pytest.approx(_entropic(out.choices[0])["entropy"], abs=1e-3)


def test_epic_decoding_on_both_endpoints_stream_and_not(client, served_model):
    """EPIC through the official client: a seeded request gives the same tokens streamed and not, with one
    ``epic`` record per token (workers/epic.py; its exactness is tested in tests/test_epic_engine.py)."""
    epic = {"entropic": {"decoding": "epic", "alpha": 0.5, "horizon": 2, "max_candidates": 4}}
    chat = client.chat.completions.create(model=served_model, messages=FACT_PROMPT, max_tokens=5, temperature=1.0,
                                          seed=3, extra_body=epic)
    records = _entropic(chat.choices[0])["epic"]
    assert len(records) == chat.usage.completion_tokens == len(_entropic(chat.choices[0])["entropy"])
    assert all(r["candidates_evaluated"] <= 4 and r["exact"] for r in records)
    assert sum(r["rollout_tokens"] for r in records) > 0
    out = client.completions.create(model=served_model, prompt="The capital of France is", max_tokens=5,
                                    temperature=1.0, seed=5, extra_body=epic)
    chunks = list(client.completions.create(model=served_model, prompt="The capital of France is", max_tokens=5,
                                            temperature=1.0, seed=5, stream=True, extra_body=epic))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    streamed = [r for c in chunks if c.choices for r in _entropic(c.choices[0]).get("epic", [])]
    assert streamed == _entropic(out.choices[0])["epic"]


def test_sse_wire_format(server, served_model):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=120, json={
        "model": served_model, "prompt": "Hello", "max_tokens": 3, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        json.loads(line[len("data: "):])


def _entropy_after_warmup(client, model, runs: dict[str, dict], temperature: float, warmup: int = 32
                          ) -> dict[str, list[float]]:
    """Per run and seed: the mean entropy of the tokens after ``warmup``. Every run's three seeds go at once
    (twelve requests over two replicas: one batch each, not one batch per run after another)."""
    def one(entropic: dict, seed: int) -> float:
        out = client.completions.create(
            model=model, prompt="Write a long story about a dragon and a knight.", max_tokens=200, seed=seed,
            temperature=temperature, extra_body={"ignore_eos": True, "entropic": entropic})
        values = _entropic(out.choices[0])["entropy"][warmup:]
        return sum(values) / len(values)

    seeds = [11, 12, 13]
    with cf.ThreadPoolExecutor(len(runs) * len(seeds)) as pool:
        futures = {name: [pool.submit(one, entropic, seed) for seed in seeds] for name, entropic in runs.items()}
        return {name: [f.result() for f in fs] for name, fs in futures.items()}


CONVERGENCE = {"eta": 0.3, "t_min": 0.05, "t_max": 5.0, "max_log_step": 10.0}


def test_the_law_drives_entropy_to_the_target_and_a_fixed_temperature_ignores_it(client, served_model):
    """With the law on, the mean entropy lands on each target; with it off, the target changes nothing.

    The margin comes from the spread of the per-seed means (three standard errors, at least 0.15 nats).
    The uncontrolled runs use the same seeds at both targets, so they differ only where a different
    batch composition flips a sampled token; the comparison does not depend on where the model's own
    entropy at T=1 happens to lie."""
    targets = (1.0, 4.0)
    means = _entropy_after_warmup(client, served_model, {
        **{f"law {t}": {**CONVERGENCE, "target_entropy": t} for t in targets},
        **{f"fixed {t}": {"enabled": False, "target_entropy": t} for t in targets}}, 1.0)
    controlled = {t: means[f"law {t}"] for t in targets}
    fixed = {t: means[f"fixed {t}"] for t in targets}
    for target, runs in controlled.items():
        mean = statistics.mean(runs)
        margin = max(0.15, 3 * statistics.stdev(runs) / len(runs) ** 0.5)
        assert abs(mean - target) < margin, (target, runs)
    moved = statistics.mean(controlled[4.0]) - statistics.mean(controlled[1.0])
    unmoved = abs(statistics.mean(fixed[4.0]) - statistics.mean(fixed[1.0]))
    assert moved > 2.0 and unmoved < 0.5, (controlled, fixed)


def _metric_values(text: str, name: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line.rsplit(" ", 1)
            values[labels] = float(value)
    return values


def test_debug_endpoint_shows_priorities_of_active_requests(server, client, served_model):
    import time

    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.completions.create, model=served_model, prompt="Count slowly:", max_tokens=120,
                             temperature=0, extra_body={"ignore_eos": True})
        seen = {}
        deadline = time.time() + 60
        while not seen and time.time() < deadline:
            for replica in httpx.get(f"{server}/debug/requests", timeout=10).json().values():
                seen.update({k: (pi, replica["ranks"][k]) for k, pi in replica.get("priorities", {}).items()})
            time.sleep(0.1)
        future.result(timeout=300)
    assert seen, "no active request showed a priority"
    assert all(pi > 0 and rank >= 1 for pi, rank in seen.values())


LONG_PROMPT = ("Remember this: the secret colour is turquoise. " + "The grass is green. The sky is blue. " * 160
               + "What is the secret colour? The secret colour is")


def test_kv_pruning_on_the_serving_path(client, served_model):
    # ~1.5K tokens: above the default min_context_tokens (1024), so the deployment's default (a fixed budget)
    # prunes from the first decode step
    out = client.completions.create(model=served_model, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    kv_blocks = _entropic(out.choices[0])["kv_blocks"]
    assert len(kv_blocks) == out.usage.completion_tokens - 1  # every decode step (the first token is prefill)
    assert all(kept < total for kept, total in kv_blocks), kv_blocks
    assert "turquoise" in out.choices[0].text
    # short context: pruning switches itself off (every block kept); opting out: no pruning telemetry at all
    short = client.completions.create(model=served_model, prompt="The sky is", max_tokens=4, temperature=0)
    assert all(kept == total for kept, total in _entropic(short.choices[0])["kv_blocks"])
    off = client.completions.create(model=served_model, prompt=LONG_PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"entropic": {"pruning": {"enabled": False}}})
    assert "kv_blocks" not in _entropic(off.choices[0])


def test_metrics_endpoint_shows_every_replica_and_the_entropic_series(server, client, served_model):
    client.completions.create(model=served_model, prompt="Hi", max_tokens=4)
    deadline = time.time() + 15  # a replica's metrics reach the merged page with its next once-a-second report
    while True:
        text = httpx.get(f"{server}/metrics", timeout=30).text
        if sum(_metric_values(text, "entropic_token_entropy_nats_count").values()) > 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    running = _metric_values(text, "vllm:num_requests_running")
    assert len({re.search(r'replica="([^"]+)"', k).group(1) for k in running}) == 2, running
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_requests_waiting",
                 "entropic_token_entropy_nats_count", "entropic_token_temperature_count",
                 "entropic_request_entropic_time_nats_count", "entropic_estimator_seconds_count",
                 "entropic_engine_step_seconds_count", "entropic_priority_count",
                 "entropic_priority_preemptions_total", "entropic_telemetry_lag_seconds_count",
                 "entropic_controller_loop_seconds_count", "entropic_kv_blocks_kept_ratio_count",
                 "entropic_attention_flops_saved_total", "entropic_kv_bytes_saved_total",
                 "entropic_pruning_selection_seconds_total", "entropic_decode_kernel_layers_total",
                 "entropic_grants_renewed_total",
                 "entropic_grant_withheld_steps_total", "entropic_routing_decisions_total",
                 "entropic_dispatch_admissions_total", "entropic_dispatch_queue_length",
                 "entropic_dispatch_wait_seconds_count", "entropic_dispatch_landed_total",
                 "entropic_remaining_work_model", "entropic_borrowed_core_steps_total"):
        assert _metric_values(text, name), name
    assert sum(_metric_values(text, "entropic_token_entropy_nats_count").values()) > 0


BAD_REQUESTS = [
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": FACT_PROMPT, "max_tokens": 0}, "max_tokens"),
    ("completion", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("chat", {"messages": FACT_PROMPT, "temperature": -0.5}, "temperature"),
    ("completion", {"prompt": "hello " * 9000, "max_tokens": 4}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
    ("completion", {"prompt": "hello", "max_tokens": 8192}, "max_tokens"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"eta": "fast"}}, "entropic.eta"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"target_entropy": -1}}, "entropic.target_entropy"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"estimator": "magic"}}, "entropic.estimator"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"t_min": 3.0, "t_max": 1.0}}, "entropic"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"unknown": 1}}, "entropic.unknown"),
    ("chat", {"messages": FACT_PROMPT, "entropic": [1, 2]}, "entropic"),
    ("completion", {"prompt": ""}, "prompt"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"pruning": {"keep_min": 0}}}, "entropic.pruning.keep_min"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"pruning": {"entropy_low": 4, "entropy_high": 1}}}, "entropic"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"pruning": {"blocks": 3}}}, "entropic.pruning.blocks"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"pruning": {"budget": "adaptive"}}}, "entropic.pruning.budget"),
    ("chat", {"messages": FACT_PROMPT, "entropic": {"decoding": "beam"}}, "entropic.decoding"),
    ("chat", {"messages": FACT_PROMPT, "temperature": 0, "entropic": {"decoding": "epic"}}, "temperature"),
    ("chat", {"messages": FACT_PROMPT, "logprobs": True, "entropic": {"decoding": "epic"}}, "logprobs"),
    ("chat", {"messages": "not a list"}, "messages"),
    # vLLM fields this server does not honour: refused by name, never parsed and ignored
    ("chat", {"messages": FACT_PROMPT, "priority": 3}, "priority"),
    ("completion", {"prompt": "x", "session_id": "s-1"}, "session_id"),
    ("chat", {"messages": FACT_PROMPT, "reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"messages": FACT_PROMPT, "include_reasoning": False}, "include_reasoning"),
    ("completion", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completion", {"prompt": "x", "logprobs": 1, "logprob_token_ids": [5]}, "logprob_token_ids"),
    # a role vLLM does not type passes its fields unvalidated (schemathesis found a 500 on /tokenize with tool_calls: 1)
    ("chat", {"messages": [{"role": "developer", "content": "", "tool_calls": [{"function": 3}]}]},
     "messages[0].tool_calls[0].function"),
]


@pytest.mark.parametrize("kind,body,param", BAD_REQUESTS, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_400_naming_the_field(server, kind, body, param):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    response = httpx.post(f"{server}{path}", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["message"]
    assert error["param"] == param or (error["param"] or "").startswith(param + "."), error


def test_an_unknown_model_gets_404_as_from_vllm(server, client, served_model):
    for path, body in (("/v1/chat/completions", {"model": "no-such-model", "messages": FACT_PROMPT}),
                       ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
                       ("/tokenize", {"model": "no-such-model", "prompt": "x"})):
        response = httpx.post(f"{server}{path}", json=body, timeout=60)
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
        assert "`no-such-model` does not exist" in error["message"] and served_model in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=FACT_PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    card = client.models.retrieve(served_model)
    assert card.id == served_model and card.model_extra["max_model_len"] > 0


def test_a_response_is_named_by_the_clients_request_id_as_in_vllm(server, served_model):
    body = {"model": served_model, "messages": FACT_PROMPT, "max_tokens": 1}
    named = httpx.post(f"{server}/v1/chat/completions", json={**body, "request_id": "abc-1"}, timeout=60).json()
    assert named["id"] == "chatcmpl-abc-1"
    header = httpx.post(f"{server}/v1/chat/completions", json=body, headers={"X-Request-Id": "xyz-2"}, timeout=60)
    assert header.json()["id"] == "chatcmpl-xyz-2"
    a, b = (httpx.post(f"{server}/v1/completions", json={"model": served_model, "prompt": "Hi", "max_tokens": 1},
                       timeout=60).json()["id"] for _ in range(2))
    assert a.startswith("cmpl-") and a != b


def test_the_openapi_schema_declares_the_request_bodies_the_server_parses(server, served_model):
    """Schema-driven clients and fuzzers learn the real bodies: vLLM's protocol models with ``entropic``."""
    from jsonschema import Draft202012Validator

    doc = httpx.get(f"{server}/openapi.json", timeout=60).json()
    bodies = {path: doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")}

    def validator(path: str) -> Draft202012Validator:
        return Draft202012Validator({**bodies[path], "components": doc["components"]})

    good = {"model": served_model, "messages": FACT_PROMPT, "max_tokens": 2, "entropic": {"target_entropy": 1.5}}
    assert not list(validator("/v1/chat/completions").iter_errors(good))
    assert httpx.post(f"{server}/v1/chat/completions", json=good, timeout=60).status_code == 200
    bad = {**good, "entropic": {"target_entropy": "high"}}  # what the server refuses, the schema refuses
    assert list(validator("/v1/chat/completions").iter_errors(bad))
    assert httpx.post(f"{server}/v1/chat/completions", json=bad, timeout=60).status_code == 400
    assert not list(validator("/tokenize").iter_errors({"prompt": "Hi"}))
    assert not list(validator("/detokenize").iter_errors({"tokens": [1, 2]}))
    assert list(validator("/detokenize").iter_errors({"tokens": ["a"]}))


def test_n_choices_each_carry_their_own_telemetry_and_usage_adds_up(client, served_model):
    out = client.chat.completions.create(model=served_model, messages=FACT_PROMPT, max_tokens=8, temperature=1.0,
                                         seed=5, n=3, extra_body={"entropic": {"target_entropy": 1.0}})
    assert [c.index for c in out.choices] == [0, 1, 2]
    lengths = []
    for choice in out.choices:
        entropic = _entropic(choice)
        assert len(entropic["entropy"]) == len(entropic["temperature"]) >= 1
        lengths.append(len(entropic["entropy"]))
    assert out.usage.completion_tokens == sum(lengths)
    assert len({c.message.content for c in out.choices}) > 1  # seeds 5, 6, 7: three draws, not one copied
    stream = client.completions.create(model=served_model, prompt="Once upon a time", max_tokens=6, n=2, seed=1,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    tokens, finished, usage = {0: 0, 1: 0}, set(), None
    for chunk in stream:
        for c in chunk.choices:
            tokens[c.index] += len(c.model_extra["entropic"]["entropy"])
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert tokens == {0: 6, 1: 6} and finished == {0, 1} and usage.completion_tokens == 12


def test_a_batch_of_prompts_answers_each_in_order_as_vllm_does(client, served_model):
    prompts = ["The capital of France is", "Once upon a time"]
    out = client.completions.create(model=served_model, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    ones = [client.completions.create(model=served_model, prompt=q, max_tokens=4, temperature=0) for q in prompts]
    assert out.choices[0].text == out.choices[1].text == ones[0].choices[0].text  # greedy: prompt 0's choices
    assert out.choices[2].text == out.choices[3].text == ones[1].choices[0].text
    assert out.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in ones)  # each prompt counted once
    assert out.usage.completion_tokens == sum(len(_entropic(c)["entropy"]) for c in out.choices)
    ids = client.completions.create(model=served_model, prompt=[[504, 3575, 282], [504, 3575]], max_tokens=2,
                                    temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_token_ids_truncation_and_salt_as_vllm_takes_them(server, client, served_model):
    text = "The grass is green and the sky is blue."
    ids = httpx.post(f"{server}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    out = client.completions.create(model=served_model, prompt=text, max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True, "cache_salt": "tenant-a"})
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == out.usage.completion_tokens
    chunks = list(client.completions.create(model=served_model, prompt=text, max_tokens=3, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert [c.choices[0].model_extra["prompt_token_ids"] for c in chunks if c.choices][0] == ids
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == choice["token_ids"]
    cut = client.completions.create(model=served_model, prompt=text, max_tokens=1, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].model_extra["prompt_token_ids"] == ids[-4:]
    chat = client.chat.completions.create(model=served_model, messages=FACT_PROMPT, max_tokens=2, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 65])
def test_n_out_of_range_gets_400(server, served_model, n):
    response = httpx.post(f"{server}/v1/chat/completions", json={"model": served_model, "messages": FACT_PROMPT,
                                                                   "n": n}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text


def test_version_names_the_vllm_it_runs(server):
    import vllm

    body = httpx.get(f"{server}/version", timeout=30).json()
    assert body["version"] == vllm.__version__ and "entropic_serve" in body


def test_tokenize_counts_what_generation_counts_and_detokenize_inverts_it(server, client, served_model):
    """/tokenize runs the code a replica runs to turn a request into ids, so its count is the prompt_tokens
    the same request is billed for."""
    chat = client.chat.completions.create(model=served_model, messages=FACT_PROMPT, max_tokens=1)
    tokens = httpx.post(f"{server}/tokenize", json={"model": served_model, "messages": FACT_PROMPT}, timeout=60).json()
    assert tokens["count"] == len(tokens["tokens"]) == chat.usage.prompt_tokens
    completion = client.completions.create(model=served_model, prompt="The capital of France is", max_tokens=1)
    plain = httpx.post(f"{server}/tokenize", json={"prompt": "The capital of France is", "return_token_strs": True},
                       timeout=60).json()
    assert plain["count"] == completion.usage.prompt_tokens and len(plain["token_strs"]) == plain["count"]
    bare = httpx.post(f"{server}/tokenize", json={"prompt": "Entropy is a measure.", "add_special_tokens": False},
                      timeout=60).json()
    text = httpx.post(f"{server}/detokenize", json={"tokens": bare["tokens"]}, timeout=60).json()
    assert text == {"prompt": "Entropy is a measure."}
    for path, body, param in (("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"messages": FACT_PROMPT, "chat_template": "{{ messages }}"},
                               "chat_template"),
                              ("/tokenize", {}, "prompt")):
        response = httpx.post(f"{server}{path}", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert (response.json()["error"]["param"] or "").startswith(param), response.text


def test_malformed_json_gets_400(server):
    response = httpx.post(f"{server}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


def test_openai_client_raises_bad_request(client, served_model):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served_model, messages=FACT_PROMPT, max_tokens=0)


def test_bad_requests_do_not_disturb_a_concurrent_stream(server, client, served_model):
    def good() -> str:
        stream = client.completions.create(model=served_model, prompt="Count: one, two,", max_tokens=40,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)

    with cf.ThreadPoolExecutor(4) as pool:
        future = pool.submit(good)
        codes = [httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).status_code
                 for _, body, _ in BAD_REQUESTS[:6] for _ in range(2)]
        text = future.result(timeout=300)
    assert set(codes) == {400}
    assert len(text) > 0
    assert httpx.get(f"{server}/health").status_code == 200
