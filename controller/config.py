"""Typed configuration of entropy-aware scheduling (paper §3.1), shared by the controller and replicas."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from controller.laws.grants import GrantPolicy
from controller.laws.migration import MigrationPolicy
from controller.laws.prefill_gate import PrefillGatePolicy
from controller.laws.priority import PriorityWeights


class SchedulingConfig(BaseModel):
    """π(s) orders admission, batch and preemption; its weights and the control loop around it."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    alpha: float = Field(1.0, gt=0, description="weight of compute (attended context)")
    beta: float = Field(0.5, gt=0, description="weight of KV memory held")
    gamma: float = Field(1.0, gt=0, description="weight of latency slack")
    aging_s: float = Field(5.0, gt=0, description="a waiting request's π doubles every aging_s seconds")
    slo_s: float = Field(30.0, gt=0, description="end-to-end latency objective behind the slack term")
    delta: float = Field(2.0, ge=0, description="weight of remaining work (max_tokens left) in π's cost; "
                         "0: the paper's π")
    ref_output_tokens: float = Field(128.0, gt=0, description="unit of remaining work")
    remaining_cap_tokens: float = Field(512.0, gt=0, description="remaining work counts at most this many tokens")
    drop_ewma: float = Field(0.2, gt=0, le=1, description="EWMA weight of dH+ in E[dH]")
    prior_drop: float = Field(0.3, ge=0, description="E[dH] (nats/token) assumed before a request's first token")
    entropy_terms: bool = Field(True, description="false: E[dH] is prior_drop for every request, so π orders by "
                                "cost, slack, remaining work and aging alone, and the remaining-work predictor has "
                                "no entropy features (the no-entropy baseline)")
    objective: Literal["pi", "srpt"] = Field("pi", description="srpt: shortest remaining work first, aged (π's "
                                             "remaining-work term alone: no entropy, compute, memory or slack), the "
                                             "baseline bench-dispatch compares π with")
    predict_remaining: bool = Field(True, description="the controller learns remaining work from finished requests "
                                    "and uses it for π, routing and dispatch once it beats max_tokens minus generated "
                                    "on held-out requests; false, or until then: max_tokens minus generated")
    preempt_margin: float | None = Field(
        None, ge=1, description="π ratio a waiting request needs to preempt a running one; None: no priority "
        "preemption (vLLM still preempts the lowest π under KV pressure)")
    controller_timeout_s: float = Field(0.25, gt=0, description="older controller answers fall back to local π")
    grant_slots: int | None = Field(
        None, ge=1, description="decode-step grants: how many sequences per replica get their lease renewed each "
        "control period (highest π first); the others pause, keeping their KV, when their lease runs out. "
        "None: everyone is granted (no pausing)")
    grant_lease_steps: int = Field(8, ge=1, description="decode steps per granted lease")
    tpot_target_decode_steps: float | None = Field(
        5.0, gt=1, description="mean time per output token to hold for decoding requests, in decode-only steps of "
        "this replica's whole batch (every running and waiting request decoding): engine steps carry other "
        "requests' prefill chunks only as often as keeps a decoding request's mean gap between tokens within "
        "this many such steps (controller.laws.prefill_gate). "
        "Deferred prompts wait, so time to first token grows instead. None, with tpot_target_ms unset, turns the "
        "gate off: prefill chunks join every step, as in vLLM")
    tpot_target_ms: float | None = Field(
        None, gt=0, description="the same target as a time, in place of tpot_target_decode_steps when set")

    def grant_policy(self) -> GrantPolicy:
        return GrantPolicy(slots=self.grant_slots, lease_steps=self.grant_lease_steps)

    def prefill_gate_policy(self) -> PrefillGatePolicy | None:
        if self.tpot_target_ms is not None:
            return PrefillGatePolicy(target_gap_s=self.tpot_target_ms / 1000)
        if self.tpot_target_decode_steps is not None:
            return PrefillGatePolicy(target_decode_steps=self.tpot_target_decode_steps)
        return None

    def weights(self) -> PriorityWeights:
        return PriorityWeights(alpha=self.alpha, beta=self.beta, gamma=self.gamma, aging_s=self.aging_s,
                               delta=self.delta, ref_output_tokens=self.ref_output_tokens,
                               remaining_cap_tokens=self.remaining_cap_tokens, srpt=self.objective == "srpt")


class DispatchConfig(BaseModel):
    """Late binding: new requests wait in the controller's cluster-wide queue, highest π first, until a
    replica has a free batch slot and KV cache for them (controller.dispatcher)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="off: each request goes to a replica on arrival (Serve's router) and "
                          "waits in that replica's scheduler")
    max_queued: int = Field(256, ge=1, description="requests waiting in the controller's queue; past it, 503 with "
                            "Retry-After")
    max_wait_s: float | None = Field(None, gt=0, description="longest a request may wait for a replica before it is "
                                     "shed (503 with Retry-After); None: scheduling.slo_s, since a request dispatched "
                                     "later cannot meet its SLO")
    admit_timeout_s: float = Field(0.5, gt=0, description="longest the ingress waits for the controller to take a "
                                   "request into its queue; slower or unreachable, the request goes to Serve's "
                                   "router instead")
    in_flight_s: float = Field(2.0, gt=0, description="a dispatched request counts against its replica's free slots "
                               "until the replica's telemetry shows it, or this long")
    stale_after_s: float = Field(3.0, gt=0, description="a replica not heard from for this long gets nothing")


class MigrationConfig(BaseModel):
    """Requests stuck in one replica's queue move to a replica that can start them sooner
    (controller.laws.migration; the replica aborts the request before anything of it was computed, and the
    ingress sends it to the new replica)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="off: a request waits on the replica Serve's router sent it to")
    after_s: float = Field(1.0, ge=0, description="a request must have waited this long on its replica, with "
                           "nothing computed, before it may move")
    min_gain_s: float = Field(0.05, ge=0, description="it moves only if it is expected to start at least this much "
                              "sooner on the other replica (what resending costs)")
    max_moves: int = Field(1, ge=1, description="how often one request may move")
    in_flight_s: float = Field(2.0, gt=0, description="a moved request counts against its new replica's free slots "
                               "until that replica's telemetry shows it, or this long")

    def policy(self) -> MigrationPolicy:
        return MigrationPolicy(after_s=self.after_s, min_gain_s=self.min_gain_s, max_moves=self.max_moves)
