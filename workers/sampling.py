"""Entropy-stabilized sampling as a vLLM V1 logits processor (adapter; written for vllm 0.32.0).

Per request (keyed by the caller's request key in ``SamplingParams.extra_args["entropic"]``,
never by batch index: vLLM removes and re-adds rows on preemption and rescheduling):

* control rows (sampling requests with control enabled): logits are divided by
  T_cal * T_t, the entropy estimate H_t of that distribution is taken, and the law of
  ``controller.laws.temperature`` gives T_{t+1}. vLLM's own temperature for these requests
  is 1.0 (set by the engine runner), so T_t is the whole sampling temperature.
* observed rows (greedy requests, or control disabled): logits are left as they are; the
  entropy of the calibrated distribution the request samples from (softmax(z / (T_cal *
  T_request))) is still recorded, since the other control layers consume it. Greedy rows
  record the entropy of softmax(z / T_cal) (the model's calibrated predictive entropy)
  with temperature 0.

T_cal is the post-hoc calibration of paper §5 (p_cal ∝ exp(z / T_cal), fitted on held-out
text by ``controller.laws.calibration``): it enters the entropy every layer reads, so an
overconfident model (T_cal > 1) cannot drive pruning or scheduling with artificially low
entropy. It changes what a row samples only for control rows, which sample from p_cal.

The processor declares itself not argmax-invariant so vLLM calls it for greedy rows too
(argmax-invariant processors are skipped on greedy batches); it never changes a greedy
row, so greedy output is untouched. It runs before vLLM's penalties and top-k/top-p, so
H_t is the entropy of the full tempered distribution before truncation.

Records are (H_t, T_t) per output position. A row whose sample vLLM discards (a partial
prefill chunk) is processed again at the same position: the record is overwritten and the
temperature step is recomputed from the same starting point.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from controller.laws.temperature import TemperatureLaw, next_temperature, smoothed_entropy
from kernels import cpu_entropy
from kernels.entropy import Estimator, estimate, exact_entropy_and_log_norm
from workers.control_params import EXTRA_ARGS_KEY, EntropicArgs

_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy


@dataclass
class _RequestState:
    key: str
    control: bool
    law: TemperatureLaw
    estimator: Estimator
    topk: int
    ema_alpha: float
    t_cal: float
    greedy: bool
    observe_temperature: float
    output_ids: list[int]
    t_next: float
    stop_ids: tuple[int, ...] = ()  # EOS and the request's stop token ids (vLLM's all_stop_token_ids)
    stop_prob: float | None = None  # mass on stop_ids at the latest position: how likely the request ends now
    pruning: dict[str, Any] | None = None  # read by workers.pruned_attention through workers.pruning_state
    t_cur: float = 0.0
    pos: int = -1
    ema_base: float | None = None
    ema: float | None = None
    records: list[tuple[float, float]] = field(default_factory=list)

    @classmethod
    def from_args(cls, args: EntropicArgs, params: SamplingParams, output_ids: list[int]) -> _RequestState:
        greedy = params.temperature < _GREEDY_EPS
        law = TemperatureLaw(target_entropy=args.target_entropy, eta=args.eta, t_min=args.t_min, t_max=args.t_max,
                             max_log_step=args.max_log_step)
        return cls(
            key=args.key, control=args.control and not greedy, law=law, estimator=Estimator(args.estimator),
            topk=args.topk, ema_alpha=args.ema_alpha, t_cal=args.t_cal,
            greedy=greedy, observe_temperature=1.0 if greedy else float(params.temperature),
            output_ids=output_ids, t_next=args.t0, pruning=args.pruning,
            stop_ids=tuple(sorted(params.all_stop_token_ids)),
        )

    def begin_position(self) -> None:
        pos = len(self.output_ids)
        if pos != self.pos:
            self.pos = pos
            self.t_cur = self.t_next
            self.ema_base = self.ema

    @property
    def entropy(self) -> float:
        """The latest (smoothed) entropy estimate; nan before the first token."""
        return math.nan if self.ema is None else self.ema

    @property
    def divisor(self) -> float:
        """Logits / divisor: the distribution whose entropy is recorded (and, for control rows, sampled)."""
        return self.t_cal * (self.t_cur if self.control else self.observe_temperature)

    def record(self, entropy: float) -> None:
        self.ema = smoothed_entropy(self.ema_base, entropy, self.ema_alpha)
        if self.control:
            self.t_next = next_temperature(self.t_cur, self.ema, self.law)
        shown_t = self.t_cur if self.control else (0.0 if self.greedy else self.observe_temperature)
        while len(self.records) < self.pos:  # positions sampled before the state existed
            self.records.append((math.nan, math.nan))
        entry = (entropy, shown_t)
        if self.pos < len(self.records):
            self.records[self.pos] = entry
        else:
            self.records.append(entry)


class EntropicLogitsProcessor(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            EntropicArgs.of(sampling_params)
        except TypeError as exc:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] is not an EntropicArgs: {exc}") from None

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _RequestState] = {}
        self._by_key: dict[str, _RequestState] = {}
        self.estimator_seconds = 0.0
        from workers.pruning_state import STATE

        STATE.attach_rows(self._rows)

    def is_argmax_invariant(self) -> bool:
        return False

    # --- engine-thread API (the engine runner reads telemetry between steps) -------------
    def records(self, key: str) -> list[tuple[float, float]]:
        state = self._by_key.get(key)
        return state.records if state is not None else []

    def stop_prob(self, key: str) -> float | None:
        state = self._by_key.get(key)
        return state.stop_prob if state is not None else None

    def forget(self, key: str) -> None:
        self._by_key.pop(key, None)

    # --- vLLM hooks --------------------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            args = EntropicArgs.of(params) if params is not None else None
            state = self._by_key.get(args.key) if args is not None else None
            if state is None:
                state = _RequestState.from_args(args, params, output_ids) if args is not None else None
                if state is not None:
                    self._by_key[state.key] = state
            else:
                state.output_ids = output_ids  # resumed after preemption: same controller state
            if state is None:
                self._rows.pop(index, None)
            else:
                self._rows[index] = state
        apply_moves(self._rows, batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        n = logits.shape[0]
        rows = sorted(i for i in self._rows if i < n)
        if not rows:
            return logits
        states = [self._rows[i] for i in rows]
        for state in states:
            state.begin_position()
        started = time.perf_counter()
        measured = self._exact_on_cpu(logits, rows, states)
        if measured is not None:
            entropy, log_norm = measured
            self._record_stop_mass(logits, rows, [1.0 / s.divisor for s in states], states, log_norm)
            self._divide_control_rows(logits, rows, states, keep_scaled=False)  # after reading them undivided
        else:
            scaled = self._divide_control_rows(logits, rows, states, keep_scaled=True)
            assert scaled is not None
            entropy, log_norm = self._estimate(scaled, states)
            self._record_stop_mass(scaled, range(len(states)), [1.0] * len(states), states, log_norm)
        values = entropy.tolist()
        self.estimator_seconds += time.perf_counter() - started

        for state, h in zip(states, values):
            state.record(h)
        return logits

    @staticmethod
    def _exact_on_cpu(logits: torch.Tensor, rows: list[int], states: list[_RequestState]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(H, log-normalizer) [len(rows)] of each row's calibrated, tempered distribution from one C call
        over the undivided logits (kernels.cpu_entropy), when every row asks for the exact entropy on a CPU;
        None otherwise, or where the kernel is unavailable."""
        if logits.is_cuda or any(s.estimator is not Estimator.EXACT for s in states):
            return None
        scale = torch.ones(logits.shape[0], dtype=torch.float32)  # rows not ours are measured and ignored
        scale[rows] = torch.tensor([1.0 / s.divisor for s in states], dtype=torch.float32)
        measured = cpu_entropy.exact_entropy_and_log_norm(logits, scale)
        if measured is None:
            return None
        entropy, log_norm = measured
        if len(rows) == logits.shape[0]:
            return entropy, log_norm
        index = torch.tensor(rows)
        return entropy.index_select(0, index), log_norm.index_select(0, index)

    @staticmethod
    def _divide_control_rows(logits: torch.Tensor, rows: list[int], states: list[_RequestState],
                             keep_scaled: bool) -> torch.Tensor | None:
        """Divide the control rows of ``logits`` in place by their divisors (vLLM samples from them).
        With ``keep_scaled``, returns every row of ``rows`` divided [len(rows), vocab] (the torch
        estimators' input), else None."""
        n = logits.shape[0]
        every_row = len(rows) == n  # rows are sorted and distinct, so they are 0..n-1
        control = [j for j, s in enumerate(states) if s.control]
        if not keep_scaled and not control:
            return None
        divisors = torch.tensor([s.divisor for s in states], dtype=logits.dtype).to(logits.device).unsqueeze(1)
        if every_row and len(control) == len(states):
            return logits.div_(divisors)  # the common case: one in-place pass, no copies
        if not keep_scaled:
            sel = torch.tensor(control, device=logits.device)
            target = torch.tensor([rows[j] for j in control], device=logits.device)
            logits.index_copy_(0, target, logits.index_select(0, target) / divisors.index_select(0, sel))
            return None
        index = None if every_row else torch.tensor(rows, device=logits.device)
        scaled = (logits if index is None else logits.index_select(0, index)) / divisors
        if control:
            sel = torch.tensor(control, device=logits.device)
            target = sel if index is None else index.index_select(0, sel)
            logits.index_copy_(0, target, scaled.index_select(0, sel))
        return scaled

    @staticmethod
    def _estimate(scaled: torch.Tensor, states: list[_RequestState]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's entropy by its estimator (torch or Triton), and the log-normalizers where the exact
        estimator computed them."""
        groups = _group_by_estimator(states)
        if len(groups) == 1:
            (est, k), = groups
            if est is Estimator.EXACT and not scaled.is_cuda:
                return exact_entropy_and_log_norm(scaled)
            return estimate(scaled, est, k), None
        entropy = torch.empty(len(states), dtype=torch.float32, device=scaled.device)
        for (est, k), members in groups.items():
            sel = torch.tensor(members, device=scaled.device)
            entropy.index_copy_(0, sel, estimate(scaled.index_select(0, sel), est, k))
        return entropy, None

    @staticmethod
    def _record_stop_mass(logits: torch.Tensor, row_of_state: Sequence[int], scale: list[float],
                          states: list[_RequestState], log_norm: torch.Tensor | None) -> None:
        """p(stop token) of each state's distribution, ``softmax(logits[row_of_state[j]] * scale[j])``: a
        feature of the controller's remaining-work predictor. ``log_norm`` [len(states)]: each
        distribution's log-sum-exp, when the entropy pass computed it."""
        vocab = logits.shape[1]
        pairs = [(j, t) for j, s in enumerate(states) for t in s.stop_ids if t < vocab]
        if not pairs:
            return
        device = logits.device
        state_of = torch.tensor([j for j, _ in pairs], device=device)
        rows = torch.tensor([row_of_state[j] for j, _ in pairs], device=device)
        factor = torch.tensor([scale[j] for j, _ in pairs], device=device)
        if log_norm is None:
            members = torch.tensor(list(row_of_state), device=device)
            factors = torch.tensor(scale, device=device).unsqueeze(1)
            log_norm = torch.logsumexp(logits.index_select(0, members).float() * factors, dim=-1)  # [states]
        picked = (logits[rows, torch.tensor([t for _, t in pairs], device=device)].float() * factor
                  - log_norm.to(device)[state_of]).exp()
        mass = torch.zeros(len(states), device=device).index_add_(0, state_of, picked).tolist()
        for j in {j for j, _ in pairs}:
            states[j].stop_prob = mass[j]


def apply_moves(rows: dict[int, Any], batch_update: BatchUpdate) -> None:
    """Follow vLLM's row moves (condensing, swaps) in a batch-index -> state map."""
    for src, dst, direction in batch_update.moved:
        a, b = rows.pop(src, None), rows.pop(dst, None)
        if a is not None:
            rows[dst] = a
        if direction == MoveDirectionality.SWAP and b is not None:
            rows[src] = b


def _group_by_estimator(states: list[_RequestState]) -> dict[tuple[Estimator, int], list[int]]:
    groups: dict[tuple[Estimator, int], list[int]] = {}
    for j, s in enumerate(states):
        k = s.topk if s.estimator is not Estimator.EXACT else 0
        groups.setdefault((s.estimator, k), []).append(j)
    return groups
