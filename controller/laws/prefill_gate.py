"""Prefill gate: how many engine steps may carry prefill chunks while other requests decode.

A decoding request gets one token per engine step, so its time per output token is the mean length of
the steps it shares. A step that carries a prefill chunk (up to ``max_num_batched_tokens`` prompt tokens)
lasts many decode-only steps on a CPU, so when long prompts keep arriving a decoding request's tokens
wait mostly for other requests' prompts. Holding a mean gap of ``target`` means letting a share φ of
those steps carry prefill, with

    φ·prefill_step + (1 − φ)·decode_step = target.

The target is either a time (``target_gap_s``) or a number of decode-only steps
(``target_decode_steps``): a bound on how much other requests' prefill may slow a decoding request,
which means the same on any machine and model. The steps counted are those of the whole batch, every
running and waiting request decoding (the caller's estimate), not of the batch decoding now: at the
start of a wave of long prompts a few requests decode while many prompts wait, and a target counted in
those short steps would hold prefill back hardest exactly when most requests wait for their first token.

Deferred prompt tokens are not dropped: they wait, so what the gate buys in time per output token is
paid in time to first token, and in throughput where the decoding batch thins out meanwhile. A credit
of φ per contended step (decodes running and prefill waiting), spent whole by a step that carries
prefill, spreads those steps evenly; ``min_share`` keeps admission going however slow prefill steps
are.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillGatePolicy:
    target_gap_s: float | None = None  # mean time between a decoding request's tokens to hold
    target_decode_steps: float | None = None  # or as a multiple of the whole batch's decode-only step
    min_share: float = 0.05  # share of contended steps that carry prefill whatever the step times

    def __post_init__(self) -> None:
        if (self.target_gap_s is None) == (self.target_decode_steps is None):
            raise ValueError("exactly one of target_gap_s and target_decode_steps")
        if self.target_gap_s is not None and self.target_gap_s <= 0:
            raise ValueError("target_gap_s must be positive")
        if self.target_decode_steps is not None and self.target_decode_steps <= 1:
            raise ValueError("target_decode_steps must exceed 1 (a decode-only step is the shortest gap)")
        if not 0 < self.min_share <= 1:
            raise ValueError("min_share must be in (0, 1]")

    def target_s(self, full_decode_step_s: float) -> float:
        if self.target_gap_s is not None:
            return self.target_gap_s
        assert self.target_decode_steps is not None
        return self.target_decode_steps * full_decode_step_s


def prefill_share(policy: PrefillGatePolicy, decode_step_s: float | None, prefill_step_s: float | None,
                  full_decode_step_s: float | None = None) -> float:
    """φ: the share of contended steps that may carry prefill, from the decode-only step now and, for a
    target in steps, the decode-only step of the whole batch (default: the step now). 1 (no gate) until both
    step kinds have been timed, where steps that carry prefill already meet the target, and where decode-only
    steps alone miss it: deferring prefill could not reach the target there and would only cost time to
    first token."""
    if decode_step_s is None or prefill_step_s is None:
        return 1.0
    target = policy.target_s(decode_step_s if full_decode_step_s is None else full_decode_step_s)
    if prefill_step_s <= target or decode_step_s >= target:
        return 1.0
    return max(policy.min_share, (target - decode_step_s) / (prefill_step_s - decode_step_s))


def full_batch_step_s(per_sequence_s: float | None, batch: int) -> float | None:
    """The decode-only step of ``batch`` sequences, from the smoothed decode-only step per decoding sequence.
    Linear: a step's fixed part (reading the weights) counts once per sequence, so at small batches this
    overestimates the whole batch's step, which errs towards letting prefill through."""
    return None if per_sequence_s is None else per_sequence_s * max(1, batch)


def admit_prefill(credit: float, share: float) -> tuple[bool, float]:
    """One contended step: whether it may carry prefill, and the credit after it (in [0, 1): steps without
    contention do not ask, so they bank nothing)."""
    credit += share
    if credit >= 1.0 - 1e-9:  # ten steps of 0.1 make one step's worth, not 0.9999999999999999
        return True, max(0.0, credit - 1.0)
    return False, credit
