"""OpenAI-compatible HTTP ingress (FastAPI inside Ray Serve).

Validates at the edge (400 with an OpenAI-style error object naming the field), forwards
the parsed request to a worker replica as a stream of ``Delta`` items, and formats them as
OpenAI responses: SSE ``data:`` lines ending with ``data: [DONE]``, or one JSON body.
Every choice carries the ``entropic`` extension, which standard clients ignore.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.messages import Admission, Grant
from deployments import logprobs as lp
from deployments import protocol as p
from deployments.config import AppConfig
from deployments.drain import DrainMiddleware
from deployments.http_policy import PolicyMiddleware
from deployments.token_channel import Ticket, TokenSink
from deployments.tool_calls import ToolCalls
from workers.aio import wait_for
from workers.control_params import EPIC_FIELDS
from workers.errors import InvalidRequest, ReplicaUnavailable, RequestError, RequestFailed, RequestMoved

logger = logging.getLogger(__name__)
_ATTEMPTS = 4  # replicas tried for one request before its first output
_RETRY_BACKOFF_S = 0.2  # doubled after each failed try: a failed replica leaves within a second
_RETRY_AFTER_S = 5
_HEALTH_TIMEOUT_S = 2.0
app = FastAPI(title="entropic-serve", description="OpenAI-compatible API with entropy control")
app.add_middleware(DrainMiddleware)
app.add_middleware(PolicyMiddleware)  # added last, so outermost: CORS and keys before anything else


# The handlers read their bodies themselves (to bound their size and answer every mistake in the OpenAI
# shape), so FastAPI cannot see them: the schema declares them from the models they are parsed with, and the
# answers from the models they are written with.
_REQUEST_MODELS = ("EntropicChatCompletionRequest", "EntropicCompletionRequest", "TokenizeCompletionRequest",
                   "TokenizeChatRequest", "DetokenizeRequest")
_RESPONSE_MODELS = ("EntropicChatResponse", "EntropicChatStreamResponse", "EntropicCompletionResponse",
                    "EntropicCompletionStreamResponse", "TokenizeResponse", "DetokenizeResponse", "ErrorResponse")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _body(*models: str, answer: str, chunk: str | None = None) -> dict[str, Any]:
    """The operation's request body (any of ``models``), its answer, and with ``chunk`` its SSE stream: each
    ``data:`` line one ``chunk`` object, then ``data: [DONE]``."""
    schema = _ref(models[0]) if len(models) == 1 else {"anyOf": [_ref(m) for m in models]}
    error = {"description": "OpenAI error object", "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    ok: dict[str, Any] = {"description": "the answer", "content": {"application/json": {"schema": _ref(answer)}}}
    if chunk is not None:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string", "description": (
            f"with stream: true, server-sent events: each `data:` line a {chunk} (#/components/schemas/{chunk}), "
            "the last `data: [DONE]`")}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": ok, "400": error, "404": error}}


def _openapi() -> dict[str, Any]:
    """FastAPI's schema plus the models the handlers parse and answer with (vLLM's protocol models, ours on top)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        models: list[tuple[Any, Literal["validation", "serialization"]]] = [
            (getattr(p, n), "validation") for n in _REQUEST_MODELS]
        models += [(getattr(p, n), "serialization") for n in _RESPONSE_MODELS]
        refs, generated = models_json_schema(models, ref_template="#/components/schemas/{model}")
        components.update(generated.get("$defs", {}))
        for (model, mode), name in zip(models, _REQUEST_MODELS + _RESPONSE_MODELS):
            ref = refs[(model, mode)]["$ref"].rsplit("/", 1)[-1]
            components[name] = components[ref] if ref == name else {"$ref": f"#/components/schemas/{ref}"}
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi


def _error(message: str, param: str | None = None, code: int = 400, kind: str = "BadRequestError",
           retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(p.error_body(message, param, code, kind), status_code=code, headers=headers)


def _invalid(exc: InvalidRequest) -> JSONResponse:
    if isinstance(exc, p.ModelNotFound):
        return _error(exc.message, exc.param, code=404, kind="NotFoundError")
    return _error(exc.message, exc.param)


class _AtCapacity(Exception):
    """The controller's queue shed a request (full, or past its deadline)."""


class _DeadlineExceeded(Exception):
    """The request ran past ``request_timeout_s``."""


def _timed_out(timeout: float | None) -> str:
    return f"the request ran past its deadline of {timeout} s (request_timeout_s)"


async def _until(items: AsyncIterator[Any], deadline: float | None) -> AsyncIterator[Any]:
    """``items`` until the event loop's clock reaches ``deadline``, then ``_DeadlineExceeded``; the iterator is
    closed by the cancellation, so its streams (and the engines' slots) are released."""
    if deadline is None:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    while True:
        try:
            item = await wait_for(anext(items), deadline - loop.time())
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _DeadlineExceeded from None
        yield item


def _too_large(limit: int) -> JSONResponse:
    return _error(f"the request body is larger than {limit} bytes", code=413, kind="RequestTooLargeError")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404, 405 and the like in the OpenAI error shape."""
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "HTTPError")
    response = _error(str(exc.detail), code=exc.status_code, kind=kind)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything a handler did not foresee: an OpenAI 500 that names nothing internal, logged once here."""
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error("internal server error", code=500, kind="InternalServerError")


def _failure_message(exc: BaseException, request_id: str) -> str:
    """What a client is told when its generation fails midway: never a traceback, pid, address or actor id."""
    if isinstance(exc, (RequestFailed, ReplicaUnavailable)):
        message = exc.message
    elif isinstance(exc, RayActorError):
        message = "the replica serving this request stopped"
    else:
        message = "generation failed"
    logger.warning("request %s failed: %s", request_id, message, exc_info=not isinstance(exc, RequestFailed))
    return f"{message} (request {request_id})"


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def _chunk_entropic(delta: Any) -> dict[str, Any]:
    body = {"entropy": _finite(delta.entropy), "temperature": _finite(delta.temperature),
            "entropic_time": delta.entropic_time}
    if delta.kv_blocks:
        body["kv_blocks"] = [list(kt) for kt in delta.kv_blocks]
    if delta.epic:
        body["epic"] = [dataclasses.asdict(step) for step in delta.epic]
    return body


def _sse(payload: Any) -> str:
    body = payload.model_dump_json(exclude_unset=False) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


def _usage(last: list[Any], n: int) -> p.UsageInfo:
    """Over every choice's last delta: each prompt once (choices come prompt by prompt, ``n`` each), the
    completions summed, as vLLM counts them."""
    prompt = sum(d.prompt_tokens for d in last[::n])
    completion = sum(d.completion_tokens for d in last)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Choice:
    """One choice's text and logprobs as the client asked for them, delta by delta: the prompt echoed before the
    first piece (completions; chat echoes the last message when its role is the reply's, as vLLM does), and
    logprobs in the endpoint's shape."""

    def __init__(self, kind: str, request: Any, names: lp.TokenNames | None, echo_text: str | None) -> None:
        self.kind = kind
        self.top = lp.wanted(kind, request)
        self.names = names
        self.echo_text = echo_text  # None: nothing to echo, or already sent
        self.echo_only = kind == "completion" and bool(request.echo) and request.max_tokens == 0
        self.offset = 0  # completions' text_offset continues across stream chunks
        self.prompt_positions: list[Any] = []  # vLLM's prompt_logprobs field, when asked for
        self.prompt_ids: list[int] = []  # the prompt as the engine saw it (the first delta brings it)
        self.token_ids = bool(request.return_token_ids)  # vLLM's return_token_ids: the ids beside the text
        self.generated: list[int] = []
        self._ids_sent = False
        self.tools = ToolCalls.of(kind, request)  # output constrained to tool calls
        if self.tools is not None:
            self.echo_text = None  # the reply is calls, not text to continue

    def piece(self, delta: Any) -> tuple[str, Any]:
        """(text, logprobs object or None) for this delta."""
        if delta.prompt_logprobs:
            self.prompt_positions += delta.prompt_logprobs
        if delta.prompt_token_ids is not None:
            self.prompt_ids = delta.prompt_token_ids
        if self.token_ids:
            self.generated += delta.token_ids
        if self.top is None and self.echo_text is None and not self.echo_only:
            return delta.text, None  # the common case: the text as it came
        text, positions, first_ids = delta.text, list(delta.logprobs or []), list[int]()
        if self.kind == "completion" and self.echo_text is not None:
            if self.top is not None and not delta.prompt_logprobs and not delta.token_ids:
                return "", None  # the prompt's logprobs come with its first token: echo them together
            prompt = delta.prompt_logprobs or []
            text = self.echo_text + ("" if self.echo_only else text)
            positions = prompt + ([] if self.echo_only else positions)
            first_ids = self.prompt_ids[:1]
            self.echo_text = None
        elif self.echo_only:  # the token generated only to end the request is not part of the answer
            text, positions = "", []
        if self.top is None:
            return text, None
        assert self.names is not None
        if self.kind == "chat":
            return text, lp.chat(positions, self.top, self.names)
        out, self.offset = lp.completion(positions, first_ids, self.names, self.offset)
        return text, out

    def prompt_ids_once(self, first: Any) -> list[int] | None:
        """With return_token_ids, the prompt's ids for the stream's first chunk of this choice, else None."""
        if not self.token_ids or self._ids_sent:
            return None
        self._ids_sent = True
        return first.prompt_token_ids

    def take_echo(self) -> str:
        """Chat: the echoed message, sent once, ahead of the reply."""
        text, self.echo_text = self.echo_text or "", None
        return text


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, worker: Any, controller: Any, config: dict[str, Any]) -> None:
        self.worker = worker
        # One streaming handle for all requests: its request router (and the in-flight counts the router
        # keeps per replica) must outlive a single request.
        self.worker_stream = worker.options(stream=True)
        self.controller = controller
        self.controller_stream = controller.options(stream=True)
        self.config = AppConfig.model_validate(config)
        self.model_name = self.config.model_name
        # where worker replicas send a stream's tokens after its first (deployments/token_channel.py)
        self._tokens = TokenSink(ray.util.get_node_ip_address()) if self.config.token_channel else None
        # Imported here: Serve pickles this class by value, and a module-level name would be a copy
        from deployments.http_policy import POLICY

        POLICY.configure(self.config.http)
        self._tokenizer: Any = None
        self._view_polls = 0
        if self.config.request_router == "soonest_served":
            self._routing_poll = asyncio.get_event_loop().create_task(self._poll_routing_view())
        from deployments.ray_metrics import mirror_periodically
        from deployments.routing_view import ROUTING_REGISTRY

        self._metrics_mirror = mirror_periodically(ROUTING_REGISTRY.collect, "ingress")

    async def _poll_routing_view(self) -> None:
        """Every routing_view_period_s: the controller's view of replica loads, for the request router."""
        from deployments.routing_view import CONTROLLER_VIEW

        while True:
            await asyncio.sleep(self.config.routing_view_period_s)
            try:
                CONTROLLER_VIEW.publish(await wait_for(self.controller.routing_view.remote(),
                                                       timeout=self.config.scheduling.controller_timeout_s))
                self._view_polls += 1
            except Exception as exc:  # controller down or late: the router falls back to Serve's stats
                logger.debug("routing view poll failed: %r", exc)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests with 503 from now on and wait up to ``timeout_s`` for the ones in flight to
        end (deployments.server calls it on SIGTERM, before Serve shuts down); how many are still running."""
        # Imported here: Serve pickles this class by value, and a module-level name would be a copy of
        # the state the middleware (of the module's own app) counts in.
        from deployments.drain import DRAIN

        left = await DRAIN.drain(timeout_s)
        logger.info("drained: %d request(s) still in flight", left)
        return left

    # --- plain endpoints ------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """Ready when some worker replica's engine loop is alive: one that reported to the controller
        within STALE_AFTER_S (a replica whose engine stopped says nothing more, idle ones report once a
        second). Asks the controller, never a worker, so it does not queue behind generation; with the
        controller away, a worker's own health check through Serve decides."""
        from deployments.routing_view import STALE_AFTER_S

        try:
            view = await wait_for(self.controller.routing_view.remote(), timeout=_HEALTH_TIMEOUT_S)
            live = [r for r, age in view.ages_s.items() if age <= STALE_AFTER_S]
            if live:
                return Response(status_code=200)
            return _error("no worker replica has a running engine", code=503, kind="ServiceUnavailableError",
                          retry_after=_RETRY_AFTER_S)
        except Exception as exc:  # the controller is restarting: ask Serve to run one worker's health check
            logger.info("health: controller unreachable (%s); asking a worker", type(exc).__name__)
        try:
            await wait_for(self.worker.check_health.remote(), timeout=_HEALTH_TIMEOUT_S)
        except Exception:
            return _error("no healthy worker replica answered", code=503, kind="ServiceUnavailableError",
                          retry_after=_RETRY_AFTER_S)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        card = p.ModelCard(id=self.model_name, root=self.config.model, max_model_len=self.config.engine.max_model_len,
                           owned_by="entropic-serve")
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.model_name:
            return _invalid(p.ModelNotFound(model_id, self.model_name))
        card = p.ModelCard(id=self.model_name, root=self.config.model, max_model_len=self.config.engine.max_model_len,
                           owned_by="entropic-serve")
        return JSONResponse(card.model_dump())

    @app.get("/version")
    async def version(self) -> JSONResponse:
        """vLLM's version, as ``vllm serve`` answers, and this server's."""
        from importlib.metadata import PackageNotFoundError, version

        import vllm

        try:
            ours = version("entropic-serve")
        except PackageNotFoundError:  # run from a checkout that was never installed
            ours = None
        return JSONResponse({"version": vllm.__version__, "entropic_serve": ours})

    @app.post("/tokenize", openapi_extra=_body("TokenizeCompletionRequest", "TokenizeChatRequest",
                                                         answer="TokenizeResponse"))
    async def tokenize(self, raw: Request) -> JSONResponse:
        """As ``vllm serve``'s: the token ids a prompt or a chat becomes, by the code a replica runs
        (workers.prompts), with the model's tokenizer loaded here on first use."""
        from workers.prompts import encode, render_chat

        try:
            request = p.parse_tokenize(await self._json(raw), self.model_name)
            tokenizer = await self._get_tokenizer()
            if isinstance(request, p.TokenizeChatRequest):
                text, param = render_chat(request, tokenizer), "messages"
            else:
                text, param = request.prompt, "prompt"
            ids = encode(tokenizer, text, request.add_special_tokens, param)
        except InvalidRequest as exc:
            return _invalid(exc)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return JSONResponse(p.TokenizeResponse(count=len(ids), max_model_len=self.config.engine.max_model_len,
                                               tokens=ids, token_strs=strs).model_dump())

    @app.post("/detokenize", openapi_extra=_body("DetokenizeRequest", answer="DetokenizeResponse"))
    async def detokenize(self, raw: Request) -> JSONResponse:
        try:
            request = p.parse_detokenize(await self._json(raw), self.model_name)
            tokenizer = await self._get_tokenizer()
            if any(t >= len(tokenizer) for t in request.tokens):
                raise InvalidRequest(f"token ids must be in [0, {len(tokenizer)})", "tokens")
        except InvalidRequest as exc:
            return _invalid(exc)
        return JSONResponse(p.DetokenizeResponse(prompt=tokenizer.decode(request.tokens)).model_dump())

    async def _json(self, raw: Request) -> Any:
        payload = await raw.body()
        if len(payload) > self.config.max_request_bytes:
            raise InvalidRequest(f"the request body is larger than {self.config.max_request_bytes} bytes")
        try:
            return json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequest(f"the request is nested more than {p.MAX_JSON_DEPTH} levels deep") from None

    async def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from vllm.tokenizers import get_tokenizer

            from workers.model_store import resolve_model

            path = await asyncio.to_thread(resolve_model, self.config.model)
            self._tokenizer = await asyncio.to_thread(get_tokenizer, str(path))
        return self._tokenizer

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Every worker replica's series, merged by the controller; 503 while it has none of them (it is
        restarting, or none reported yet): a partial page would read as replicas gone idle."""
        from controller.metrics_merge import merge_families, render
        from deployments.routing_view import ROUTING_REGISTRY

        try:
            families = await wait_for(self.controller.metric_families.remote(), timeout=10)
        except Exception as exc:
            logger.info("metrics: controller unreachable (%s)", type(exc).__name__)
            families = []
        sources = {s.labels.get("replica") for family in families for s in family.samples}
        if not sources - {"controller", None}:
            return _error("metrics are unavailable until the controller has heard from a worker replica",
                          code=503, kind="ServiceUnavailableError", retry_after=1)
        families += merge_families({"ingress": ROUTING_REGISTRY.collect()})
        return Response(render(families), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/requests")
    async def debug_requests(self) -> JSONResponse:
        try:
            return JSONResponse(await wait_for(self.controller.profiles.remote(), timeout=10))
        except Exception as exc:
            logger.info("debug: controller unreachable (%s)", type(exc).__name__)
            return _error("the controller is unavailable", code=503, kind="ServiceUnavailableError", retry_after=1)

    @app.get("/debug/routing")
    async def debug_routing(self) -> JSONResponse:
        """This ingress's routing: decisions by source of the load used, and the controller's view."""
        from deployments.routing_view import CONTROLLER_VIEW, decision_counts

        return JSONResponse({"router": self.config.request_router, "decisions": decision_counts(),
                             "view_polls": self._view_polls, "view": CONTROLLER_VIEW.snapshot()})

    @app.get("/debug/dispatch")
    async def debug_dispatch(self) -> JSONResponse:
        """The controller's queue and slot accounting, and this ingress's admissions by outcome."""
        from deployments.routing_view import admission_counts

        try:
            queue = await wait_for(self.controller.dispatch_view.remote(), timeout=10)
        except Exception as exc:
            logger.info("debug: controller unreachable (%s)", type(exc).__name__)
            queue = None
        return JSONResponse({"enabled": self.config.dispatch.enabled, "admissions": admission_counts(),
                             "controller": queue})

    # --- generation -------------------------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=_body("EntropicChatCompletionRequest", answer="EntropicChatResponse",
                                                                   chunk="EntropicChatStreamResponse"))
    async def chat_completions(self, raw: Request) -> Response:
        return await self._generate("chat", raw)

    @app.post("/v1/completions", openapi_extra=_body("EntropicCompletionRequest", answer="EntropicCompletionResponse",
                                                              chunk="EntropicCompletionStreamResponse"))
    async def completions(self, raw: Request) -> Response:
        return await self._generate("completion", raw)

    async def _generate(self, kind: str, raw: Request) -> Response:
        declared = raw.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.config.max_request_bytes:
            return _too_large(self.config.max_request_bytes)
        payload = bytearray()
        async for piece in raw.stream():  # counted as it arrives: a body without a length is bounded too
            payload += piece
            if len(payload) > self.config.max_request_bytes:
                return _too_large(self.config.max_request_bytes)
        try:
            body = json.loads(bytes(payload))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"the request body is not valid JSON: {exc}")
        except RecursionError:
            return _error(f"the request is nested more than {p.MAX_JSON_DEPTH} levels deep")
        try:
            request = p.parse_request(kind, body, self.model_name)
        except InvalidRequest as exc:
            return _invalid(exc)
        except Exception as exc:  # a validator we did not foresee: still an error object, never a bare 500
            logger.exception("request validation failed")
            return _error(f"invalid request: {exc}")
        per_choice = p.choice_requests(kind, request)
        timeout = self.config.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:  # n > 1 or several prompts: one request per choice, each with its own telemetry
            async with asyncio.timeout_at(deadline):
                starts = await self._start_all(kind, per_choice)
        except TimeoutError:
            return _error(_timed_out(timeout), code=408, kind="RequestTimeoutError")
        except _AtCapacity:
            return _error("the server is at capacity; retry shortly", code=503, kind="ServiceUnavailableError",
                          retry_after=_RETRY_AFTER_S)
        except InvalidRequest as exc:
            return _invalid(exc)
        except ReplicaUnavailable as exc:
            return _error(exc.message, code=503, kind="ServiceUnavailableError", retry_after=_RETRY_AFTER_S)
        except RequestFailed as exc:
            return _error(exc.message, code=500, kind="InternalServerError")
        except BackPressureError:  # Serve's queue for the workers is full (max_queued_requests)
            return _error("the server is at capacity; retry shortly", code=503, kind="ServiceUnavailableError",
                          retry_after=_RETRY_AFTER_S)
        except Exception:
            logger.exception("generation failed before its first output")
            return _error("generation failed", code=500, kind="InternalServerError")
        # Named as vllm serve names a response, from the client's id: the body's request_id if it sent one,
        # else the X-Request-Id header (Serve's proxy adds one, its own id, when the client sent none)
        client_id = request.request_id if "request_id" in request.model_fields_set else raw.headers.get("x-request-id")
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{client_id or request.request_id}"
        created = int(time.time())
        choices = await self._choices(kind, request, per_choice)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._sse(kind, request_id, created, starts, choices, include_usage, request.n or 1, deadline),
                media_type="text/event-stream"
            )
        return await self._full(kind, request_id, created, starts, choices, request.n or 1, deadline)

    async def _choices(self, kind: str, request: Any, per_choice: list[Any]) -> list[_Choice]:
        """What each choice's deltas become; loads the tokenizer when logprobs or an echo need it."""
        names, tokenizer = None, None
        if lp.wanted(kind, request) is not None or (kind == "completion" and request.echo):
            tokenizer = await self._get_tokenizer()
            names = lp.TokenNames(lambda t: tokenizer.decode([t]), bool(request.return_tokens_as_token_ids))
        return [_Choice(kind, one, names, self._echo(kind, one, tokenizer)) for one in per_choice]

    @staticmethod
    def _echo(kind: str, request: Any, tokenizer: Any) -> str | None:
        """What ``echo`` prepends: a completion's prompt; for chat, the last message when its role is the reply's."""
        if not request.echo:
            return None
        if kind == "completion":
            [prompt] = p.prompts(request)
            return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        last = dict(request.messages[-1])
        role = "assistant" if request.add_generation_prompt else last.get("role")
        content = last.get("content")
        return content if last.get("role") == role and isinstance(content, str) and content else None

    async def _admit(self, key: str, kind: str, request: Any) -> Grant | None:
        """With dispatch on, wait in the controller's queue for a replica: the ``Grant`` (a replica, or shed).
        None: dispatch is off, or the controller did not take the request within ``admit_timeout_s``
        (down, restarting, late): Serve's router chooses, as without dispatch. A controller that fails
        while the request waits gets it once more, with the time already waited, so a restarted one
        rebuilds its queue in the same order."""
        from deployments import routing_view

        dispatch = self.config.dispatch
        if not dispatch.enabled:
            return None
        tokens, max_tokens = p.prompt_estimate(kind, request)
        max_wait = dispatch.max_wait_s or self.config.scheduling.slo_s
        options = p.overrides(request) or {}
        try:
            factor = self.config.epic.merged({k: options[k] for k in EPIC_FIELDS if k in options}).forward_tokens_per_token()
        except ValueError:  # the replica answers it with a 400
            factor = 1.0
        started = time.monotonic()
        for _ in range(2):
            waited = time.monotonic() - started
            answers = self.controller_stream.admit.remote(Admission(
                key=key, prompt_tokens=tokens, max_tokens=max_tokens, waited_s=waited, max_wait_s=max_wait,
                compute_factor=factor))
            try:
                await wait_for(answers.__anext__(), dispatch.admit_timeout_s)  # queued
                grant = await wait_for(answers.__anext__(), max_wait - waited + dispatch.admit_timeout_s)
            except asyncio.CancelledError:  # the client left: the controller withdraws it
                answers.cancel()
                raise
            except Exception as exc:
                answers.cancel()
                logger.info("dispatch: the controller did not answer (%s)", type(exc).__name__)
                if time.monotonic() - started > max_wait:
                    break
                continue
            routing_view.record_admission("controller" if grant.replica_id is not None else grant.shed or "none")
            return grant
        routing_view.record_admission("fallback")
        return None

    async def _start(self, kind: str, request: Any, grant: Grant | None = None) -> tuple[Any, Any]:
        """Send the request to a replica (the granted one first, with dispatch) and wait for its first output.

        Nothing has been generated until then, so a replica that cannot take it (its engine
        stopped, the actor died) is not the client's problem: try another, a few times. A replica may also
        hand it back unstarted for another the controller chose (migration): it goes there, under its key.
        """
        attempt = 0
        while True:
            ticket = await self._ticket()
            stream = self.worker_stream.generate.remote(kind, request, p.overrides(request), grant, ticket)
            try:
                first = await stream.__anext__()
                if isinstance(first, RequestError):  # deployments.worker yields expected failures
                    raise first
                if ticket is not None:
                    assert self._tokens is not None
                    return first, self._tokens.stream(stream, ticket)
                return first, stream
            except StopAsyncIteration:
                self._release(ticket)
                raise RequestFailed("the engine produced no output") from None
            except RequestMoved as moved:  # the controller bounds how often one request moves
                self._release(ticket)
                stream.cancel()
                grant = Grant(key=moved.key, replica_id=moved.replica_id)
                continue
            except (ReplicaUnavailable, RayActorError) as exc:
                self._release(ticket)
                stream.cancel()
                if attempt + 1 == _ATTEMPTS:
                    raise ReplicaUnavailable("no replica could take the request; retry shortly") from exc
                logger.warning("replica unavailable (%s); retrying the request", type(exc).__name__)
                if grant is not None:  # the granted replica failed it: Serve's router chooses the next
                    grant = dataclasses.replace(grant, replica_id=None)
                await asyncio.sleep(_RETRY_BACKOFF_S * 2**attempt)
                attempt += 1
            except BaseException:
                self._release(ticket)
                stream.cancel()  # release the call, so the router's in-flight count for that replica drops
                raise

    async def _ticket(self) -> Ticket | None:
        if self._tokens is None:
            return None
        try:
            return await self._tokens.ticket()
        except OSError:  # cannot listen on this node's address: every stream goes through Serve's handle
            logger.exception("the token channel could not listen; streaming through Serve's handle instead")
            self._tokens = None
            return None

    def _release(self, ticket: Ticket | None) -> None:
        if ticket is not None and self._tokens is not None:
            self._tokens.release(ticket.stream_id)

    async def _admit_and_start(self, kind: str, request: Any, own_call_ids: bool = False) -> tuple[Any, Any]:
        if own_call_ids:
            # Serve names every handle call after the HTTP request it is made for, and its router tracks calls
            # by that name: the choices of one request, sent at once, must not share it (they hung when they did)
            from ray.serve import context
            from ray.serve._private.utils import generate_request_id

            parent = context._get_serve_request_context()
            context._serve_request_context.set(dataclasses.replace(parent, _internal_request_id=generate_request_id()))
        grant = await self._admit(f"{kind}-{uuid.uuid4().hex}", kind, request)
        if grant is not None and grant.shed in ("queue_full", "deadline"):
            raise _AtCapacity
        return await self._start(kind, request, grant)

    async def _start_all(self, kind: str, choices: list[Any]) -> list[tuple[Any, Any]]:
        """Admit and start each choice's request; if one cannot start, none goes on."""
        if len(choices) == 1:
            return [await self._admit_and_start(kind, choices[0])]
        # a task each, so each sets its own Serve request context
        tasks = [asyncio.ensure_future(self._admit_and_start(kind, c, own_call_ids=True)) for c in choices]
        try:
            started = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # past the deadline, or the client left: release the choices that started
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[1].cancel()
            raise
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for r in started:
                if not isinstance(r, BaseException):
                    r[1].cancel()
            raise failed[0]
        return [r for r in started if not isinstance(r, BaseException)]

    async def _deltas(self, first: Any, stream: Any) -> AsyncIterator[Any]:
        yield first
        async for delta in stream:
            if isinstance(delta, RequestError):
                raise delta
            yield delta

    async def _indexed(self, starts: list[tuple[Any, Any]]) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, delta) as each choice's deltas arrive; the first failure of any choice is raised."""
        if len(starts) == 1:
            ended = False
            try:
                async for delta in self._deltas(*starts[0]):
                    yield 0, delta
                ended = True
            finally:  # past the deadline or the client left: release the call, so the engine frees the slot
                if not ended:
                    starts[0][1].cancel()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, first: Any, stream: Any) -> None:
            try:
                async for delta in self._deltas(first, stream):
                    queue.put_nowait((i, delta, None))
                queue.put_nowait((i, None, None))
            except Exception as exc:
                queue.put_nowait((i, None, exc))

        pumps = [asyncio.ensure_future(pump(i, first, stream)) for i, (first, stream) in enumerate(starts)]
        try:
            running = len(starts)
            while running:
                i, delta, exc = await queue.get()
                if exc is not None:
                    raise exc
                if delta is None:
                    running -= 1
                else:
                    yield i, delta
        finally:  # the client left or a choice failed: the other choices stop too
            for pump_task in pumps:
                pump_task.cancel()
            for _, stream in starts:
                stream.cancel()

    async def _sse(self, kind: str, rid: str, created: int, starts: list[tuple[Any, Any]], choices: list[_Choice],
                   include_usage: bool, per_prompt: int, deadline: float | None):
        last = [first for first, _ in starts]
        try:
            if kind == "chat":
                for i, (first, _) in enumerate(starts):
                    yield _sse(p.EntropicChatStreamResponse(
                        id=rid, created=created, model=self.model_name, prompt_token_ids=choices[i].prompt_ids_once(first),
                        choices=[p.EntropicChatStreamChoice(
                            index=i, delta=p.DeltaMessage(role="assistant", content=choices[i].take_echo()))]))
            async for i, delta in _until(self._indexed(starts), deadline):
                last[i] = delta
                text, logprobs = choices[i].piece(delta)
                if kind == "chat":
                    tools, finish = choices[i].tools, delta.finish_reason
                    message = p.DeltaMessage(content=text) if tools is None else tools.stream(text, delta.finished)
                    if tools is not None and delta.finished:
                        finish = tools.finish_reason(finish, tools.called)
                    choice = p.EntropicChatStreamChoice(
                        index=i, delta=message, logprobs=logprobs, finish_reason=finish, entropic=_chunk_entropic(delta),
                        token_ids=delta.token_ids if choices[i].token_ids else None)
                    chunk = p.EntropicChatStreamResponse(id=rid, created=created, model=self.model_name, choices=[choice])
                else:
                    choice = p.EntropicCompletionStreamChoice(
                        index=i, text=text, logprobs=logprobs, finish_reason=delta.finish_reason,
                        entropic=_chunk_entropic(delta), prompt_token_ids=choices[i].prompt_ids_once(delta),
                        token_ids=delta.token_ids if choices[i].token_ids else None)
                    chunk = p.EntropicCompletionStreamResponse(id=rid, created=created, model=self.model_name,
                                                               choices=[choice])
                yield _sse(chunk)
            if include_usage:
                cls = p.EntropicChatStreamResponse if kind == "chat" else p.EntropicCompletionStreamResponse
                yield _sse(cls(id=rid, created=created, model=self.model_name, choices=[], usage=_usage(last, per_prompt)))
        except _DeadlineExceeded:
            yield _sse(p.error_body(_timed_out(self.config.request_timeout_s), None, 408, "RequestTimeoutError"))
        except Exception as exc:  # mid-stream failure: tell the client in-band, then end the stream
            yield _sse(p.error_body(_failure_message(exc, rid), None, 500, "InternalServerError"))
        yield "data: [DONE]\n\n"

    async def _full(self, kind: str, rid: str, created: int, starts: list[tuple[Any, Any]],
                    views: list[_Choice], per_prompt: int, deadline: float | None) -> Response:
        n = len(starts)
        text: list[list[str]] = [[views[i].take_echo()] if kind == "chat" else [] for i in range(n)]
        logprobs: list[list[Any]] = [[] for _ in range(n)]
        entropy: list[list[float]] = [[] for _ in range(n)]
        temperature: list[list[float]] = [[] for _ in range(n)]
        kv_blocks: list[list[list[int]]] = [[] for _ in range(n)]
        epic: list[list[dict]] = [[] for _ in range(n)]
        last = [first for first, _ in starts]
        try:
            async for i, delta in _until(self._indexed(starts), deadline):
                last[i] = delta
                piece, piece_logprobs = views[i].piece(delta)
                text[i].append(piece)
                if piece_logprobs is not None:
                    logprobs[i].append(piece_logprobs)
                entropy[i] += delta.entropy
                temperature[i] += delta.temperature
                kv_blocks[i] += [list(kt) for kt in delta.kv_blocks]
                epic[i] += [dataclasses.asdict(step) for step in delta.epic or ()]
        except _DeadlineExceeded:
            return _error(_timed_out(self.config.request_timeout_s), code=408, kind="RequestTimeoutError")
        except Exception as exc:
            return _error(_failure_message(exc, rid), code=500, kind="InternalServerError")
        choices = []
        for i in range(n):
            entropic = {"entropy": _finite(entropy[i]), "temperature": _finite(temperature[i]),
                        "entropic_time": last[i].entropic_time, "mean_entropy": last[i].mean_entropy,
                        "entropy_variance": last[i].entropy_variance}
            if kv_blocks[i]:
                entropic["kv_blocks"] = kv_blocks[i]
            if epic[i]:
                entropic["epic"] = epic[i]
            # vLLM's extra field, present whenever the engine computed them (prompt_logprobs, or echo with logprobs)
            prompt = lp.prompt_field(views[i].prompt_positions) if views[i].prompt_positions else None
            if kind == "chat":
                content, tools, finish = "".join(text[i]), views[i].tools, last[i].finish_reason
                message = p.ChatMessage(role="assistant", content=content)
                if tools is not None:
                    calls = tools.calls(content)
                    message = p.ChatMessage(role="assistant", content="", tool_calls=calls)
                    finish = tools.finish_reason(finish, bool(calls))
                choices.append(p.EntropicChatChoice(
                    index=i, message=message, logprobs=lp.merge_chat(logprobs[i]), finish_reason=finish,
                    entropic=entropic, token_ids=views[i].generated if views[i].token_ids else None))
            else:
                choices.append(p.EntropicCompletionChoice(
                    index=i, text="".join(text[i]), logprobs=lp.merge_completion(logprobs[i]),
                    finish_reason=last[i].finish_reason, prompt_logprobs=prompt, entropic=entropic,
                    token_ids=views[i].generated if views[i].token_ids else None,
                    prompt_token_ids=views[i].prompt_ids if views[i].token_ids else None))
        if kind == "chat":
            body = p.EntropicChatResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                            usage=_usage(last, per_prompt), prompt_logprobs=prompt,
                                            prompt_token_ids=views[0].prompt_ids if views[0].token_ids else None)
        else:
            body = p.EntropicCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                        usage=_usage(last, per_prompt))
        return JSONResponse(body.model_dump(mode="json"))
