"""Entropy-aligned decoding (EPIC) over the replica's own engine: one request, many engine requests.

vLLM runs beam search over its engine the same way: each step of the user's request is one or more
ordinary engine requests on the growing prefix, so they share the batch, the prefix cache, π scheduling,
pruning and telemetry with everything else the replica serves. Per output token:

1. The next-token distribution q(· | prefix) over its ``max_candidates`` most likely tokens, from a
   one-token request with logprobs (or, when the previous token's lookahead was rolled out, from that
   rollout's first position: the same distribution, already paid for).
2. Gumbel-Max over them: z_i = log q_i + G_i.
3. ``controller.laws.epic.LazySearch`` picks argmax z_i − α·Ĥ_i, asking for the lookahead entropy of as
   few candidates as the bounds [0, k·log V] allow, best case first, a few at a time: each is K
   rollouts of k tokens from prefix + candidate (sampled as the request asks, stopping at EOS), whose
   per-step entropies (the telemetry our logits processor records) give the Rao-Blackwellised Ĥ.

Where every remaining token is drawn untilted (α = 0, or a spent rollout budget) and the engine's top-k
sampling draws alike, the rest is one engine request instead (``_Request._rest_in_one_request``).

The support is the ``max_candidates`` most likely tokens, as top-k sampling's is (the paper's
implementation draws among the finite scores its top-k warper leaves): so α = 0 is top-k sampling with
k = max_candidates, and a draw is exact, given the estimated entropies, on that support. A token is
reported inexact (``EpicStep.exact``) where the request's rollout budget cut its search short or was
already spent (then it is drawn untilted).

q is the distribution the engine returns logprobs of: the request's temperature, top-k/top-p applied
(``engine.logprobs_mode: processed_logprobs``, the default). The temperature law does not run for EPIC
requests: the tilt is their control.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from controller.laws.entropic_time import EntropyTrace
from controller.laws.epic import LazySearch, entropy_bounds, rao_blackwell_lookahead
from workers.control_params import EXTRA_ARGS_KEY, EntropicArgs, EpicControl
from workers.engine import Delta, EngineRunner, EpicStep

# Candidates whose lookaheads are estimated together (one round of rollouts): more cuts the rounds a
# contested token waits for, fewer spends fewer rollouts on candidates the first round already settles.
_BATCH = 4


@dataclass
class _Next:
    """q(· | prefix): its most likely tokens and their logprobs, in rank order, and its entropy."""

    ids: list[int]
    logprobs: list[float]
    entropy: float | None


@dataclass
class _Lookahead:
    entropy: float
    tokens: int
    following: _Next | None  # q after prefix + the candidate, read off the first rollout


class EpicDecoder:
    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.vocab = len(runner.tokenizer)
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}

    def engine_keys(self, key: str) -> list[str]:
        """The engine requests EPIC request ``key`` has in flight (the scheduler orders them by its π)."""
        request = self._requests.get(key)
        return list(request.live) if request is not None else []

    async def generate(self, key: str, prompt_ids: list[int], params: Any, control: EpicControl,
                       alpha: float, cache_salt: str | None = None) -> AsyncIterator[Delta]:
        """The EPIC request ``key``: ``params`` are its SamplingParams as built for plain sampling
        (max_tokens, temperature, stop, seed...), its EntropicArgs with the temperature law off."""
        request = self._requests[key] = _Request(self, key, params, control, alpha, cache_salt)
        try:
            async for delta in request.run(prompt_ids):
                yield delta
        finally:
            self._requests.pop(key, None)

    async def survey(self, key: str, prefix: list[int], params: Any, control: EpicControl,
                     also: tuple[int, ...] = ()) -> tuple[list[int], list[float], dict[int, float]]:
        """q's candidates at the end of ``prefix`` (ids, log-probabilities) and the lookahead entropy of each
        and of ``also``, estimated exactly as a draw estimates them (fitting α: make fit-epic-alpha)."""
        request = _Request(self, key, params, control, 0.0, None)
        nxt = await request._next(prefix)
        tokens = list(dict.fromkeys([*nxt.ids, *also]))
        looks = await asyncio.gather(*(request._lookahead(prefix, t) for t in tokens))
        return nxt.ids, nxt.logprobs, {t: look.entropy for t, look in zip(tokens, looks)}


class _Request:
    """One EPIC request's state: its engine requests are named after it and seeded from its seed."""

    def __init__(self, decoder: EpicDecoder, key: str, params: Any, control: EpicControl, alpha: float,
                 salt: str | None) -> None:
        args = EntropicArgs.of(params)
        assert args is not None  # built by workers.prompts
        self.decoder, self.key, self.params, self.args = decoder, key, params, args
        self.control, self.alpha, self.salt = control, alpha, salt
        self.rng = random.Random(params.seed) if params.seed is not None else random.Random()
        self.tokenizer = decoder.runner.tokenizer
        self.live: set[str] = set()
        eos = None if params.ignore_eos else self.tokenizer.eos_token_id
        self.stops = {t for t in (eos, *(params.stop_token_ids or [])) if t is not None}

    async def run(self, prompt_ids: list[int]) -> AsyncIterator[Delta]:
        control = self.control
        prefix = list(prompt_ids)
        emit = _Emitter(self, prompt_ids)
        spent = 0
        following: _Next | None = None
        while True:
            if self._untilted_from(spent) and self._engine_samples_alike():
                async for delta in self._rest_in_one_request(prefix, emit, exact=self.alpha == 0):
                    yield delta
                return
            nxt = following or await self._next(prefix)
            if not nxt.ids:  # every logprob was -inf: nothing can be drawn
                raise RuntimeError("the engine returned no finite logprob for the next token")
            token, step, following = await self._draw(prefix, nxt, control.rollout_budget - spent)
            spent += step.rollout_tokens
            prefix.append(token)
            delta = emit(token, nxt.entropy, step)
            yield delta
            if delta.finished:
                return

    # --- untilted tokens: the engine's own sampling ---------------------------------------------
    def _untilted_from(self, spent: int) -> bool:
        """Every token from here on is drawn untilted: α = 0, or a rollout budget too spent for one more
        candidate (it never grows back)."""
        per_candidate = self.control.horizon * self.control.rollouts
        return self.alpha == 0 or self.control.rollout_budget - spent < per_candidate

    def _engine_samples_alike(self) -> bool:
        """Whether the engine, told top-k = ``max_candidates``, samples exactly what an untilted draw does:
        Gumbel-Max over the ``max_candidates`` most likely tokens of q. Not with top-p, which vLLM applies
        after top-k (a nucleus of the top-k distribution, not the top-k of the nucleus), nor with presence or
        frequency penalties, which count only a request's own output (a draw's one-token requests have none)."""
        p = self.params
        return p.top_p >= 1.0 and not p.presence_penalty and not p.frequency_penalty

    async def _rest_in_one_request(self, prefix: list[int], emit: _Emitter, exact: bool) -> AsyncIterator[Delta]:
        """The rest of the output as one engine request sampling top-``max_candidates``: one decode step per
        token, where a draw of its own costs an engine request per token (its prefill of the last partial
        KV block included)."""
        sub, p = self._params(self.params.max_tokens - emit.count, logprobs=None)
        requested = p.top_k if p.top_k and p.top_k > 0 else self.control.max_candidates
        p.top_k = min(requested, self.control.max_candidates)
        # The engine's stream is closed before the last delta goes out, which aborts its request where a stop
        # string ended the output early: the caller stops reading at the last delta, so a close after it would be
        # left to the garbage collector (a later turn of the loop, or never if the loop ends first).
        last: Delta | None = None
        async with aclosing(self._stream(list(prefix), sub, p)) as stream:
            async for engine_delta in stream:
                for i, token in enumerate(engine_delta.token_ids):
                    entropy = engine_delta.entropy[i] if i < len(engine_delta.entropy) else None
                    step = EpicStep(lookahead_entropy=None, candidates_evaluated=0, rollout_tokens=0, exact=exact)
                    delta = emit(token, entropy, step)
                    if delta.finished:
                        last = delta
                        break
                    yield delta
                if last is None and engine_delta.finished:  # ended by the engine (the model's length)
                    last = emit.end(engine_delta.finish_reason or "length")
                if last is not None:
                    break
        if last is not None:
            yield last

    # --- one token ------------------------------------------------------------------------------
    async def _draw(self, prefix: list[int], nxt: _Next, budget: int) -> tuple[int, EpicStep, _Next | None]:
        control, rng = self.control, self.rng
        perturbed = [lp + _gumbel(rng) for lp in nxt.logprobs]  # log-probabilities up to one constant: argmax-safe
        per_candidate = control.horizon * control.rollouts
        tilt = self.alpha if budget >= per_candidate else 0.0  # a spent budget draws untilted (and says so)
        lower, upper = entropy_bounds(control.horizon, self.decoder.vocab)
        search = LazySearch(perturbed, [lower] * len(perturbed), [upper] * len(perturbed), tilt, batch=_BATCH,
                            max_evaluations=budget // per_candidate if tilt else None)
        looked: dict[int, _Lookahead] = {}
        while (pending := search.pending()) is not None:
            results = await asyncio.gather(*(self._lookahead(prefix, nxt.ids[i]) for i in pending))
            looked.update(zip(pending, results))
            search.record(pending, [r.entropy for r in results])
        winner = search.result.index
        chosen = looked.get(winner)
        step = EpicStep(lookahead_entropy=chosen.entropy if chosen is not None else None,
                        candidates_evaluated=len(search.result.evaluated),
                        rollout_tokens=sum(r.tokens for r in looked.values()),
                        exact=search.result.exact and tilt == self.alpha)
        return nxt.ids[winner], step, chosen.following if chosen is not None else None

    # --- engine requests ------------------------------------------------------------------------
    def _params(self, max_tokens: int, logprobs: int | None) -> tuple[str, Any]:
        sub = f"{self.key}-epic-{next(self.decoder._ids)}"
        p = self.params.clone()
        p.n, p.max_tokens, p.min_tokens, p.logprobs = 1, max_tokens, 0, logprobs
        p.prompt_logprobs, p.stop, p.include_stop_str_in_output = None, [], False
        p.seed = self.rng.getrandbits(31)
        p.detokenize = False
        p.extra_args = {**(p.extra_args or {}),
                        EXTRA_ARGS_KEY: dataclasses.asdict(dataclasses.replace(self.args, key=sub, control=False))}
        return sub, p

    async def _stream(self, ids: list[int], sub: str, params: Any) -> AsyncGenerator[Delta, None]:
        """Engine request ``sub`` on ``ids``, in flight (scheduled at this request's π) while iterated."""
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if self.salt:
            prompt["cache_salt"] = self.salt
        self.live.add(sub)
        try:
            async with aclosing(self.decoder.runner.generate(sub, prompt, params, len(ids))) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self.live.discard(sub)

    async def _run(self, ids: list[int], sub: str, params: Any) -> list[Delta]:
        return [d async for d in self._stream(ids, sub, params)]

    async def _next(self, prefix: list[int]) -> _Next:
        deltas = await self._run(prefix, *self._params(1, self.control.max_candidates))
        return _first_position(deltas, self.control.max_candidates)

    async def _lookahead(self, prefix: list[int], token: int) -> _Lookahead:
        if token in self.stops:  # the sequence ends there: nothing after it is uncertain, nothing to roll out
            return _Lookahead(entropy=0.0, tokens=0, following=None)
        control = self.control
        ids = prefix + [token]
        runs = await asyncio.gather(*(self._run(ids, *self._params(control.horizon, control.max_candidates))
                                      for _ in range(control.rollouts)))
        entropies = [[h for d in deltas for h in d.entropy] for deltas in runs]
        return _Lookahead(entropy=rao_blackwell_lookahead(entropies),
                          tokens=sum(len(d.token_ids) for deltas in runs for d in deltas),
                          following=_first_position(runs[0], control.max_candidates))


class _Emitter:
    """An EPIC request's output, token by token: its text (stop strings cut, half characters held back), its
    end, its entropy trace, and the delta each token makes."""

    def __init__(self, request: _Request, prompt_ids: list[int]) -> None:
        self.request, self.prompt_ids = request, prompt_ids
        self.out: list[int] = []
        self.text_sent = ""
        self.trace = EntropyTrace()

    @property
    def count(self) -> int:
        return len(self.out)

    def end(self, reason: str) -> Delta:
        """The last delta where the engine ended the output: no token, the text a half character held back."""
        params = self.request.params
        text = self.request.tokenizer.decode(self.out, skip_special_tokens=params.skip_special_tokens)
        return self._delta([], text[len(self.text_sent):], [], [], reason, [])

    def __call__(self, token: int, entropy: float | None, step: EpicStep) -> Delta:
        request, params, out = self.request, self.request.params, self.out
        out.append(token)
        if entropy is not None:
            self.trace.add(entropy)
        finish = "stop" if token in request.stops else ("length" if len(out) >= params.max_tokens else None)
        text = request.tokenizer.decode(out, skip_special_tokens=params.skip_special_tokens)
        cut = _stop_string(text, params.stop or [], params.include_stop_str_in_output)
        if cut is not None:
            text, finish = cut, "stop"
        held = finish is None and text.endswith("\ufffd")  # half a character: wait for the rest
        new_text = "" if held else text[len(self.text_sent):]
        if not held:
            self.text_sent = text
        return self._delta([token], new_text, [] if entropy is None else [entropy], [float(params.temperature)],
                           finish, [step])

    def _delta(self, tokens: list[int], text: str, entropy: list[float], temperature: list[float],
               finish: str | None, steps: list[EpicStep]) -> Delta:
        trace, count = self.trace, len(self.out)
        return Delta(token_ids=tokens, text=text, entropy=entropy, temperature=temperature,
                     finished=finish is not None, finish_reason=finish, prompt_tokens=len(self.prompt_ids),
                     completion_tokens=count, entropic_time=trace.tau, mean_entropy=trace.mean,
                     entropy_variance=trace.variance, epic=steps,
                     prompt_token_ids=list(self.prompt_ids) if tokens and count == 1 else None)

def _first_position(deltas: list[Delta], top: int) -> _Next:
    """The distribution of the first generated position: vLLM lists the sampled token first, then the top
    tokens by rank (the sampled one once, if it is among them)."""
    first = next(d for d in deltas if d.token_ids)
    assert first.logprobs, "the engine returned no logprobs for the position"
    ranked = sorted({tid: (rank, lp) for tid, lp, rank, _ in first.logprobs[0]
                     if rank is not None and rank <= top and math.isfinite(lp)}.items(), key=lambda kv: kv[1][0])
    return _Next(ids=[tid for tid, _ in ranked], logprobs=[lp for _, (_, lp) in ranked],
                 entropy=first.entropy[0] if first.entropy else None)


def _gumbel(rng: random.Random) -> float:
    return -math.log(-math.log(rng.random() or 5e-324))


def _stop_string(text: str, stops: list[str], include: bool) -> str | None:
    """The text cut at the first stop string it contains (kept with ``include_stop_str_in_output``)."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return None
    at, s = min(hits)
    return text[: at + len(s)] if include else text[:at]
