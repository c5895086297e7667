"""Remaining work of running and queued requests, predicted from finished ones, cluster-wide
(the law: ``laws.remaining``).

Every report carries each running request's profile (``SequenceSummary``) and the requests that ended
since the last one with how many tokens they generated (``finished``). The predictor keeps a few
snapshots of each running request (when it is first seen and as its output passes 1, 4, 16, 64, ...
tokens); when the request ends at EOS, a stop string or max_tokens, each snapshot becomes a training
sample labelled with the tokens generated after it. Requests that vanish without an end (aborted,
failed) teach nothing. One request in five is held out: its samples only measure error.

Every ``refit_every`` finished requests, two models are fitted on the training window, one on prompt
length, budget and tokens so far, one adding the entropy features, and their mean absolute error on
the held-out window is compared with the budget itself (max_tokens minus generated, what π used
before). The one with the least held-out error is used; until there are ``min_samples`` held-out
samples, and whenever neither model beats it, the budget is.
"""
from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from controller.laws.remaining import WorkSnapshot, fit, mean_abs_error, predict
from controller.messages import SequenceSummary, TelemetryReport

_SNAPSHOT_AT = (0, 1, 4, 16, 64, 256, 1024, 4096)  # tokens generated
_HOLD_OUT_ONE_IN = 5
_MAX_REPLICAS = 1024  # replicas whose running requests are followed at once


def _one_in_five(key: str) -> bool:
    return zlib.crc32(key.encode()) % _HOLD_OUT_ONE_IN == 0


@dataclass(slots=True)
class _Tracked:
    snapshots: list[WorkSnapshot]
    next_at: int  # index into _SNAPSHOT_AT


class RemainingWorkPredictor:
    def __init__(self, registry: CollectorRegistry, entropy: bool = True, cap_tokens: float = 512.0,
                 window: int = 4000, min_samples: int = 30, refit_every: int = 8,
                 held_out: Callable[[str], bool] | None = None) -> None:
        """``held_out(key)``: whether a request's samples only measure error (default: one key in five,
        by hash); benchmarks pass their own to cross-validate."""
        self._entropy = entropy
        self._is_held_out = held_out or _one_in_five
        self._cap = cap_tokens
        self._train: deque[tuple[WorkSnapshot, float]] = deque(maxlen=window)
        self._held_out: deque[tuple[WorkSnapshot, float]] = deque(maxlen=window // _HOLD_OUT_ONE_IN)
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._since_fit = 0
        self._tracked: dict[str, dict[str, _Tracked]] = {}  # replica -> request key -> its snapshots
        self._weights: list[float] | None = None
        self._with_entropy = False
        self.chosen = "budget"
        self.errors: dict[str, float] = {}
        self.finished = 0
        self._error = Gauge("entropic_remaining_work_error_tokens", "Mean absolute error of remaining-work "
                            "predictions on held-out finished requests, by model (budget: max_tokens minus generated)",
                            ["model"], registry=registry)
        self._used = Gauge("entropic_remaining_work_model", "1 for the remaining-work model in use",
                           ["model"], registry=registry)
        self._publish_choice()

    def _publish_choice(self) -> None:
        for model in ("budget", "base", "entropy"):
            self._used.labels(model=model).set(1.0 if model == self.chosen else 0.0)

    # --- learning --------------------------------------------------------------------------------
    def observe(self, report: TelemetryReport) -> None:
        mine = self._tracked.setdefault(report.replica_id, {})
        for key, summary in report.summaries.items():
            tracked = mine.setdefault(key, _Tracked([], 0))
            while tracked.next_at < len(_SNAPSHOT_AT) and summary.generated >= _SNAPSHOT_AT[tracked.next_at]:
                if not tracked.snapshots or tracked.snapshots[-1].generated != summary.generated:
                    tracked.snapshots.append(self.snapshot(summary))
                tracked.next_at += 1
        for key, generated in report.finished.items():
            if key in mine:
                self._learn(key, mine.pop(key).snapshots, generated)
        # What vanished without an end (aborted, failed, or its replica's report was lost) teaches nothing.
        for gone in mine.keys() - report.summaries.keys():
            del mine[gone]
        # A replaced replica stops reporting and leaves its requests here: drop the longest-silent replicas.
        self._tracked[report.replica_id] = self._tracked.pop(report.replica_id)  # most recently heard last
        while len(self._tracked) > _MAX_REPLICAS:
            del self._tracked[next(iter(self._tracked))]

    def _learn(self, key: str, snapshots: Iterable[WorkSnapshot], generated: int) -> None:
        held_out = self._is_held_out(key)
        for s in snapshots:
            (self._held_out if held_out else self._train).append((s, float(max(0, generated - s.generated))))
        self.finished += 1
        self._since_fit += 1
        if self._since_fit >= self._refit_every and len(self._held_out) >= self._min_samples:
            self.refit()

    def refit(self) -> None:
        """Fit both models on the training window and choose by held-out error (every ``refit_every``
        finished requests on its own)."""
        self._since_fit = 0
        train, held_out = list(self._train), list(self._held_out)
        self.errors = {"budget": mean_abs_error(held_out, None)}
        fitted = {"base": (fit(train, entropy=False), False)}
        if self._entropy:
            fitted["entropy"] = (fit(train, entropy=True), True)
        for name, (weights, entropy) in fitted.items():
            self.errors[name] = mean_abs_error(held_out, weights, entropy)
        self.chosen = min(self.errors, key=lambda m: (self.errors[m], m != "budget"))
        self._weights, self._with_entropy = fitted[self.chosen] if self.chosen != "budget" else (None, False)
        for model, error in self.errors.items():
            self._error.labels(model=model).set(error)
        self._publish_choice()

    # --- predicting ------------------------------------------------------------------------------
    def snapshot(self, s: SequenceSummary) -> WorkSnapshot:
        seen = s.generated > 0 and s.last_entropy is not None
        return WorkSnapshot(prompt_tokens=s.prompt_tokens, budget_left=self._budget(s.max_tokens, s.generated),
                            generated=s.generated, mean_entropy=s.mean_entropy if seen else None,
                            last_entropy=s.last_entropy if seen else None,
                            expected_drop=s.expected_drop if seen else None,
                            stop_prob=s.stop_prob if seen else None)

    def _budget(self, max_tokens: int | None, generated: int) -> float:
        return float(max(0, max_tokens - generated)) if max_tokens is not None else self._cap

    def remaining(self, s: WorkSnapshot) -> float:
        """Tokens it will still generate, by the model in use (the budget until one beats it)."""
        if self._weights is None:
            return s.budget_left
        return predict(self._weights, s, self._with_entropy)

    def queued(self, prompt_tokens: int, max_tokens: int | None) -> float:
        return self.remaining(WorkSnapshot(prompt_tokens=prompt_tokens, budget_left=self._budget(max_tokens, 0),
                                           generated=0, mean_entropy=None, last_entropy=None, expected_drop=None))

    def stats(self) -> dict[str, Any]:
        return {"model": self.chosen, "held_out_mae_tokens": {k: v for k, v in self.errors.items() if not math.isnan(v)},
                "finished_requests": self.finished, "train_samples": len(self._train),
                "held_out_samples": len(self._held_out), "entropy_features": self._entropy}
