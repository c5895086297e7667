"""Typed entropy-control parameters: deployment defaults and the per-request ``entropic`` object.

One pydantic model serves both: the deployment config holds defaults, a request's
``entropic`` object overrides any subset of them, and ``merged`` validates the result
(for example t_min <= t_max across the two sources).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from controller.laws.pruning import Budget

EstimatorName = Literal["exact", "topk", "tail"]
EXTRA_ARGS_KEY = "entropic"


@dataclass(frozen=True, kw_only=True)
class EntropicArgs:
    """The one contract between a request and the control layers inside vLLM, carried in
    ``SamplingParams.extra_args["entropic"]`` (a plain dict there: vLLM copies and serializes it).

    Written by ``workers.prompts`` (from ``SamplingControl.request_args``); read by the logits
    processor (the temperature law and the entropy estimate), the scheduler (``key``) and the
    engine runner and attention backend (``pruning``). ``key`` names the request across all of
    them: vLLM's own request ids get a suffix, and its batch rows move.
    """

    key: str
    control: bool  # run the temperature law (sampling rows only)
    t0: float
    target_entropy: float
    eta: float
    t_min: float
    t_max: float
    max_log_step: float
    estimator: EstimatorName
    topk: int
    ema_alpha: float
    t_cal: float
    pruning: dict[str, Any] | None = None  # PruningControl.law_args(); None: dense attention

    def into(self, extra_args: dict[str, Any] | None) -> dict[str, Any]:
        """``extra_args`` with these arguments in them."""
        return {**(extra_args or {}), EXTRA_ARGS_KEY: dataclasses.asdict(self)}

    @classmethod
    def of(cls, params: Any) -> EntropicArgs | None:
        """The arguments a SamplingParams carries; None for a request that did not come through us.
        A malformed entry raises TypeError naming the field."""
        raw = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        return None if raw is None else cls(**raw)


class SamplingControl(BaseModel):
    """Entropy-stabilized sampling (paper §3.3 with the corrected sign, guards of §5)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    target_entropy: float = Field(2.0, ge=0.0, le=20.0, description="H* in nats")
    eta: float = Field(0.3, ge=0.0, le=10.0, description="gain of the temperature law")
    t_min: float = Field(0.1, gt=0.0, le=10.0)
    t_max: float | None = Field(
        None, gt=0.0, le=10.0, description="upper temperature bound; None: the request's own temperature, so the "
        "law only cools uncertain positions and never heats confident ones")
    max_log_step: float = Field(0.5, gt=0.0, le=10.0, description="bound on |log T_{t+1} - log T_t|")
    estimator: EstimatorName = "exact"
    topk: int = Field(64, ge=1, le=4096, description="k of the top-k and tail-corrected estimators")
    ema_alpha: float = Field(1.0, gt=0.0, le=1.0, description="EMA weight of the entropy fed to the law; 1 = none")
    t_cal: float = Field(1.0, gt=0.0, le=10.0, description="calibration temperature of §5: every entropy reading is "
                         "of softmax(z / T_cal), and control rows sample from it")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> SamplingControl:
        if self.t_max is not None and self.t_min > self.t_max:
            raise ValueError(f"t_min ({self.t_min}) must not exceed t_max ({self.t_max})")
        return self

    def merged(self, overrides: dict[str, Any] | None) -> SamplingControl:
        """These defaults with a request's overrides, validated together."""
        if not overrides:
            return self
        return SamplingControl.model_validate({**self.model_dump(), **overrides})

    def initial_temperature(self, requested: float | None) -> float:
        t0 = max(1.0 if requested is None else requested, self.t_min)
        return t0 if self.t_max is None else min(t0, self.t_max)

    def upper_temperature(self, requested: float | None) -> float:
        return self.initial_temperature(requested) if self.t_max is None else self.t_max

    def request_args(self, key: str, requested_temperature: float | None,
                     pruning: PruningControl | None = None) -> EntropicArgs:
        """What one request under these settings asks of the engine's control layers."""
        return EntropicArgs(
            key=key, control=self.enabled, t0=self.initial_temperature(requested_temperature),
            target_entropy=self.target_entropy, eta=self.eta, t_min=self.t_min,
            t_max=self.upper_temperature(requested_temperature),
            max_log_step=self.max_log_step if math.isfinite(self.max_log_step) else 1e9,
            estimator=self.estimator, topk=self.topk, ema_alpha=self.ema_alpha, t_cal=self.t_cal,
            pruning=pruning.law_args() if pruning is not None else None)


class PruningControl(BaseModel):
    """Entropic pruning of paged KV blocks (paper §3.2 with the guards of §3.3/§5; docs/pruning.md).

    The deployment config holds defaults; a request's ``entropic.pruning`` object overrides any
    subset. The law itself is ``controller.laws.pruning``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    budget: Budget = Field("fixed", description="fixed: keep_min of the blocks from the first decode step; entropy: "
                           "the paper's law, from keep_min at entropy_low to everything at entropy_high "
                           "(docs/pruning.md says why fixed is the default)")
    keep_min: float = Field(0.5, gt=0.0, le=1.0, description="fraction of blocks kept: always (budget fixed), or at "
                            "the lowest entropy (budget entropy)")
    entropy_low: float = Field(0.5, ge=0.0, le=20.0, description="budget entropy: at or below, keep_min (nats)")
    entropy_high: float = Field(3.0, ge=0.0, le=20.0, description="budget entropy: at or above, everything kept "
                                "(nats)")
    epsilon_h: float = Field(0.0, ge=0.0, le=20.0, description="estimator error bound added before pruning")
    entropy_min: float = Field(0.0, ge=0.0, le=20.0, description="entropy floor H_min for pruning decisions")
    min_blocks: int = Field(4, ge=2, le=4096, description="B_min; the sink and current blocks are always in")
    max_step: float = Field(0.1, gt=0.0, le=1.0, description="largest change of the keep fraction per step")
    min_context_tokens: int = Field(1024, ge=0, description="shorter contexts stay dense")
    info_weight: float = Field(1.0, ge=0.0, le=10.0, description="weight w of log S_b (block surprisal) in the score")

    @model_validator(mode="after")
    def _regime_ordered(self) -> PruningControl:
        if self.entropy_low >= self.entropy_high:
            raise ValueError(f"entropy_low ({self.entropy_low}) must be below entropy_high ({self.entropy_high})")
        return self

    def merged(self, overrides: dict[str, Any] | None) -> PruningControl:
        if not overrides:
            return self
        return PruningControl.model_validate({**self.model_dump(), **overrides})

    def law_args(self) -> dict[str, Any] | None:
        """The pruning law's parameters as the attention backend reads them (``EntropicArgs.pruning``);
        None: dense."""
        if not self.enabled:
            return None
        return self.model_dump(exclude={"enabled"})

    def wants_surprisal(self, max_context_tokens: int) -> bool:
        """Whether a request that can reach this many tokens needs token surprisal (the block weights).

        Below min_context_tokens a request never prunes, so it skips vLLM's logprobs work.
        """
        return self.enabled and self.info_weight > 0 and max_context_tokens >= self.min_context_tokens


class EpicControl(BaseModel):
    """Entropy-aligned decoding (EPIC; controller.laws.epic, workers.epic): each token is drawn from the
    model's distribution over its ``max_candidates`` most likely tokens, tilted by exp(−α·H) of the
    k-token continuation each leads to, by a lazy Gumbel-Max with lookahead rollouts through the same
    engine. Its fields sit at the top of a request's ``entropic`` object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decoding: Literal["sample", "epic"] = Field("sample", description="epic: entropy-aligned decoding for this "
                                                "request; sample: the engine's own sampling")
    alpha: float | None = Field(None, ge=-10.0, le=10.0, description="tilt α (nats⁻¹); positive favours "
                                "continuations of low entropy. None: the value fitted for the served model "
                                "(make fit-epic-alpha), 0 where none was fitted")
    horizon: int = Field(4, ge=1, le=16, description="k: lookahead tokens after each candidate")
    rollouts: int = Field(1, ge=1, le=8, description="K: rollouts per evaluated candidate (Rao-Blackwellised)")
    max_candidates: int = Field(8, ge=1, le=20, description="the support of a draw: the most likely tokens, as "
                                "top-k sampling's (vLLM returns at most 20 logprobs)")
    rollout_budget: int = Field(4096, ge=0, description="rollout tokens one request may spend; past it, its "
                                "tokens are drawn untilted")

    def merged(self, overrides: dict[str, Any] | None) -> EpicControl:
        if not overrides:
            return self
        return EpicControl.model_validate({**self.model_dump(), **overrides})

    @property
    def enabled(self) -> bool:
        return self.decoding == "epic"

    def forward_tokens_per_token(self) -> float:
        """The most engine tokens one output token can cost: every candidate's rollouts and one distribution."""
        return 1.0 + self.max_candidates * self.horizon * self.rollouts if self.enabled else 1.0


EPIC_FIELDS = tuple(EpicControl.model_fields)  # the request's ``entropic`` keys that belong to EPIC
