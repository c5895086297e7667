"""Per-request entropy profile kept by a replica (the inputs of π(s) and the telemetry summary),
and the board that carries π from the control loop to the scheduler. No vLLM imports."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from controller.laws.entropic_time import positive_drops
from controller.laws.grants import GrantPolicy, renew, runnable, spend
from controller.laws.priority import SequenceState, ewma
from controller.messages import SequenceSummary


@dataclass
class SequenceTrack:
    arrival: float
    last_progress: float
    prompt_tokens: int
    slo_s: float
    max_tokens: int | None = None  # the request's output budget (R_s of π); None: unknown, no R_s term
    generated: int = 0
    expected_drop: float | None = None
    last_entropy: float | None = None
    temperature: float | None = None
    tau: float = 0.0
    mean_entropy: float = 0.0
    stop_prob: float | None = None
    forward_tokens: int = 0  # EPIC: engine tokens spent on its output (1 per token plus its rollouts)

    def observe(self, delta, now: float, drop_weight: float) -> None:
        for step in delta.epic or ():
            self.forward_tokens += 1 + step.rollout_tokens
        for drop in positive_drops(delta.entropy, self.last_entropy)[(0 if self.last_entropy is not None else 1):]:
            self.expected_drop = ewma(self.expected_drop, drop, drop_weight)
        if delta.entropy:
            self.last_entropy = delta.entropy[-1]
        if delta.temperature:
            self.temperature = delta.temperature[-1]
        if delta.stop_prob is not None:
            self.stop_prob = delta.stop_prob
        self.generated = delta.completion_tokens
        self.tau, self.mean_entropy = delta.entropic_time, delta.mean_entropy
        if delta.token_ids:
            self.last_progress = now

    def remaining_tokens(self) -> float:
        """Decode tokens it may still generate (R_s of π); 0 when its budget is unknown."""
        return 0.0 if self.max_tokens is None else float(max(0, self.max_tokens - self.generated))

    def state(self, now: float, prior_drop: float, block_size: int, entropy_terms: bool = True) -> SequenceState:
        """π's inputs now; without ``entropy_terms`` the expected entropy drop is the prior for everyone."""
        context = self.prompt_tokens + self.generated
        # C_s prices one output token's compute: an EPIC request's rollouts multiply it
        per_token = self.forward_tokens / self.generated if self.forward_tokens and self.generated else 1.0
        return SequenceState(
            expected_drop=self.expected_drop if self.expected_drop is not None and entropy_terms else prior_drop,
            attended_tokens=float(context) * per_token, kv_blocks=context / block_size,
            waited_s=max(0.0, now - self.last_progress), slo_s=self.slo_s,
            remaining_tokens=self.remaining_tokens())

    def summary(self, now: float) -> SequenceSummary:
        return SequenceSummary(
            prompt_tokens=self.prompt_tokens, generated=self.generated, max_tokens=self.max_tokens,
            expected_drop=self.expected_drop, last_entropy=self.last_entropy, temperature=self.temperature,
            tau=self.tau, mean_entropy=self.mean_entropy, age_s=now - self.arrival, idle_s=now - self.last_progress,
            stop_prob=self.stop_prob)


class PriorityBoard:
    """Latest π per request key; written by the control loop, read by the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._priorities: dict[str, float] = {}
        self._version = 0

    def publish(self, priorities: dict[str, float]) -> None:
        with self._lock:
            self._priorities = dict(priorities)
            self._version += 1

    def snapshot(self) -> tuple[int, dict[str, float]]:
        with self._lock:
            return self._version, self._priorities


class GrantBoard:
    """Decode-step leases per request key: renewed by the control loop, spent by the engine thread."""

    def __init__(self, policy: GrantPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._leases: dict[str, int] = {}
        self.renewals = 0

    def renew(self, priorities: dict[str, float], granted: list[str] | None = None) -> None:
        """One control period: renew the leases the controller granted (``granted``), or, without its
        answer, the top ones by the π in force."""
        with self._lock:
            before = self._leases
            self._leases = renew(priorities, before, self.policy, granted)
            self.renewals += sum(1 for k, v in self._leases.items() if v == self.policy.lease_steps
                                 and before.get(k) != v)

    def allowed(self, keys: list[str]) -> set[str]:
        with self._lock:
            return set(runnable(keys, self._leases))

    def spend(self, keys: list[str]) -> None:
        with self._lock:
            spend(self._leases, keys)

    def leases(self) -> dict[str, int]:
        with self._lock:
            return dict(self._leases)
