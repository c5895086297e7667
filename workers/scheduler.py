"""vLLM scheduler ordered by π(s) (adapter; written for vllm 0.32.0's v1 Scheduler).

Runs with ``scheduling_policy="priority"``: vLLM serves smaller ``Request.priority`` first, so
a request's priority is set to −π. Before each ``schedule()``, when new priorities have been
published on the ``PriorityBoard`` (by the replica's control loop, from the controller or the
local fallback), the scheduler applies them, re-sorts ``running`` (who gets the token budget
first; under KV pressure vLLM preempts the largest priority value, i.e. the lowest π), re-heapifies
the waiting queues (admission order), and, when ``preempt_margin`` is set, preempts the lowest-π
running request when every slot is taken and a waiting request's π exceeds it by that factor (a
preemption costs a recompute of the victim's prefix). It is off by default: with aging, a
preempted request's π keeps growing until it preempts another, so under overload long generations
can be preempted again and again (measured: docs/results/README.md).

Decodes first: vLLM hands the step's token budget to ``running`` in list order and stops at the first
request the budget no longer reaches. A request still prefilling its prompt in chunks asks for the whole
budget, so sorted ahead of the decoding requests by π it left them out of the step: every running
request waited a whole prefill chunk for its next token, and a long prompt's chunks alternated with
those of others admitted with it (served at ~3.9K-token prompts: p99 inter-token gap 11.4 s against
vLLM's 6.9 s, mean TTFT 1.2x; docs/results/prefill-closed-loop.md). So before each step the requests
that need one token go first, in π order, and those still prefilling follow in the order they were
admitted, as in vLLM's FCFS: π chooses who is admitted and who decodes first, not who is starved.

Decode-step grants (``grants``, a GrantBoard; controller.laws.grants): a running request whose key
holds no lease is left out of the step, exactly like a running request vLLM's token budget did not
reach: it keeps its KV blocks and the model runner resumes it in place later (vllm 0.32.0
``GPUModelRunner._update_states`` drops unscheduled requests from the persistent batch and re-adds
them). While they are left out, the running-request limits shrink by as many, so admission cannot
fill their slots. Without a GrantBoard, or when no key holds a lease, nothing is withheld.

Prefill gate (``prefill_gate``, a PrefillGate; controller.laws.prefill_gate; its target is
``tpot_target_decode_steps``, 5 by default, or ``tpot_target_ms``; off when both are null): a step in which requests
decode while prompt tokens wait carries prefill chunks only as often as the law allows for the target mean
gap between tokens, from the times of the steps of each kind so far; the other steps run vLLM's own
``throttle_prefills`` (the data-parallel prefill cadence: prefill chunks and admissions wait, decodes
run). Without a gate every step takes prefill chunks as vLLM's does.

vLLM appends a suffix to request ids: the caller's key (``EntropicArgs.key``) maps to the
internal id in ``add_request``.
"""
from __future__ import annotations

import heapq
import math
import time

from vllm.v1.core.sched.request_queue import PriorityRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from controller.laws.prefill_gate import PrefillGatePolicy, admit_prefill, full_batch_step_s, prefill_share
from controller.laws.priority import ewma
from workers.control_params import EntropicArgs
from workers.tracking import GrantBoard, PriorityBoard


def _prefilling(request) -> bool:
    """Whether the request needs more than one token computed: a prompt (or, after a preemption, a prompt
    and its output) not yet all in the KV cache."""
    return request.num_tokens - request.num_computed_tokens > 1


class PrefillGate:
    """The gate's state in one scheduler: smoothed step times of each kind (and of a decode-only step per
    decoding sequence), timed from ``schedule`` to ``update_from_output`` (the step's model run), and the
    law's credit."""

    WEIGHT = 0.2  # of the newest step time in each kind's smoothed mean

    def __init__(self, policy: PrefillGatePolicy) -> None:
        self.policy = policy
        self.decode_step_s: float | None = None
        self.decode_per_sequence_s: float | None = None
        self.prefill_step_s: float | None = None
        self.credit = 0.0
        self.deferred_steps = 0  # contended steps that ran without prefill
        # id(SchedulerOutput) -> (scheduled at, carries prefill, sequences), until the step's output comes back
        self._pending: dict[int, tuple[float, bool, int]] = {}

    def admit(self, full_batch: int) -> bool:
        """A contended step: whether it may carry prefill. ``full_batch``: the sequences that would decode
        once every running and waiting request does (what a target in decode-only steps counts)."""
        allowed, self.credit = admit_prefill(self.credit, self.share(full_batch))
        self.deferred_steps += not allowed
        return allowed

    def share(self, full_batch: int) -> float:
        return prefill_share(self.policy, self.decode_step_s, self.prefill_step_s,
                             full_batch_step_s(self.decode_per_sequence_s, full_batch))

    def scheduled(self, output_id: int, at: float, carries_prefill: bool, sequences: int) -> None:
        if len(self._pending) > 64:  # steps whose output never came back (an engine that failed mid-step)
            self._pending.clear()
        self._pending[output_id] = (at, carries_prefill, sequences)

    def ran(self, output_id: int, at: float) -> None:
        if output_id not in self._pending:
            return
        started, prefill, sequences = self._pending.pop(output_id)
        if prefill:
            self.prefill_step_s = ewma(self.prefill_step_s, at - started, self.WEIGHT)
        else:
            self.decode_step_s = ewma(self.decode_step_s, at - started, self.WEIGHT)
            self.decode_per_sequence_s = ewma(self.decode_per_sequence_s, (at - started) / sequences, self.WEIGHT)


class EntropicScheduler(Scheduler):
    preempt_margin: float | None = None  # None: only vLLM's own (KV-pressure) preemption, in π order
    prefill_gate: PrefillGate | None = None  # None: prefill chunks join every step, as in vLLM

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.board: PriorityBoard | None = None
        self.grants: GrantBoard | None = None
        self.priority_preemptions = 0
        self.withheld_steps = 0  # (request, step) pairs left out for lack of a grant
        self._keys: dict[str, str] = {}  # vLLM's internal request id -> the caller's key
        self._applied_version = 0

    def add_request(self, request) -> None:
        args = EntropicArgs.of(request.sampling_params) if request.sampling_params is not None else None
        if args is not None:
            self._keys[request.request_id] = args.key
        super().add_request(request)

    def schedule(self, throttle_prefills: bool = False):
        if len(self._keys) > 2 * len(self.requests) + 64:  # drop finished requests' keys now and then
            self._keys = {r: k for r, k in self._keys.items() if r in self.requests}
        self._apply_priorities()
        # Stable: each group keeps its order (π for decodes, admission for chunked prefills)
        self.running.sort(key=_prefilling)
        held = self._withhold_ungranted()
        if not throttle_prefills and self._prefill_deferred():
            throttle_prefills = True
            # vLLM stops throttling once a release step leaves requests waiting ("saturated"): with prompts
            # longer than a step's token budget that is every release step, and the gate would never close
            self.prefill_capacity_bound = False
        started = time.monotonic()
        try:
            output = super().schedule(throttle_prefills)
        finally:
            if held:
                self.running.extend(held)
                self.max_num_running_reqs += len(held)
                self.max_num_active_reqs += len(held)
        if self.grants is not None:
            self.grants.spend([self._keys[r] for r in output.num_scheduled_tokens if r in self._keys])
        if self.prefill_gate is not None and output.num_scheduled_tokens:
            self.prefill_gate.scheduled(id(output), started, any(n > 1 for n in output.num_scheduled_tokens.values()),
                                        len(output.num_scheduled_tokens))
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        if self.prefill_gate is not None:
            self.prefill_gate.ran(id(scheduler_output), time.monotonic())
        return super().update_from_output(scheduler_output, model_runner_output)

    def _prefill_deferred(self) -> bool:
        """Whether the gate holds prefill out of this step: only a contended one, where requests decode while
        prompt tokens wait, asks the gate (and spends its credit)."""
        if self.prefill_gate is None:
            return False
        prefilling = sum(map(_prefilling, self.running))
        decoding = len(self.running) - prefilling
        if not decoding or not (prefilling or self.waiting):
            return False
        return not self.prefill_gate.admit(min(len(self.running) + len(self.waiting), self.max_num_running_reqs))

    def _withhold_ungranted(self) -> list:
        if self.grants is None or not self.running:
            return []
        keyed = {r.request_id: self._keys.get(r.request_id) for r in self.running}
        allowed = self.grants.allowed([k for k in keyed.values() if k is not None])
        held = [r for r in self.running if keyed[r.request_id] is not None and keyed[r.request_id] not in allowed]
        for request in held:
            self.running.remove(request)
        self.max_num_running_reqs -= len(held)
        self.max_num_active_reqs -= len(held)
        self.withheld_steps += len(held)
        return held

    def _apply_priorities(self) -> None:
        if self.board is None:
            return
        version, priorities = self.board.snapshot()
        if version == self._applied_version:
            return
        self._applied_version = version
        by_key = {k: self.requests[r] for r, k in self._keys.items() if r in self.requests}
        for key, pi in priorities.items():
            request = by_key.get(key)
            if request is not None:
                request.priority = -pi
        self.running.sort(key=lambda r: (math.inf, 0.0) if _prefilling(r) else (r.priority, r.arrival_time))
        for queue in (self.waiting, self.kv_holding_waiting):
            if isinstance(queue, PriorityRequestQueue):
                heapq.heapify(queue._heap)
        self._preempt_for_priority()

    def _preempt_for_priority(self) -> None:
        if self.preempt_margin is None or not self.waiting or len(self.running) < self.max_num_running_reqs:
            return
        best = self.waiting.peek_request()
        worst = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        # Priority 0 means "no π published yet" (a request admitted since the last update): never a victim.
        if worst.priority < 0 and -best.priority > self.preempt_margin * -worst.priority:
            self.running.remove(worst)
            self._preempt_request(worst, time.monotonic())
            self.priority_preemptions += 1
