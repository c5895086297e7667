"""The entropy-aware samplers users pick instead of ours, as vLLM logits processors (instruments; vllm 0.32.0).

Written for the sampling comparison of ``loadtest.bench_samplers`` from the published algorithms, not
from those projects' code; never on the serving path. Per request, through flat ``SamplingParams.extra_args``
keys (``sampler_key`` names the request's state):

* ``DynamicTemperature`` (llama.cpp's dynamic temperature, ``--dynatemp-range``): each step divides the
  logits by T = T_min + (T_max - T_min) * (H / log V)^exponent, with H the entropy of softmax(logits), V the
  number of finite logits, T_min = max(0, T - range), T_max = T + range. Keys: ``dynatemp_t``,
  ``dynatemp_range``, ``dynatemp_exponent``. The request's own temperature must be 1.
* ``Mirostat2`` (Basu et al. 2021, mirostat v2): tokens whose surprise -log2 p exceeds mu are masked (the
  most likely token never is); after each step mu <- mu - eta * (s - tau), s being the surprise of the token
  that was sampled, in the truncated and renormalized distribution it was drawn from; mu starts at 2 tau.
  Keys: ``mirostat_tau`` (bits), ``mirostat_eta``. The request's own temperature must be 1.
* ``Typical`` (locally typical sampling, Meister et al. 2023; Hugging Face's ``typical_p``): tokens ranked by
  how far their surprisal is from the entropy, |−log p − H|; the smallest prefix of that ranking whose
  probability reaches ``typical_p`` is kept, the rest masked. The request's own temperature must be 1.
* ``EntropyRecorder``: records, per position, the entropy (nats) of the distribution the row is sampled
  from: softmax(logits / T_request) as it reaches the sampler (vLLM applies the request's temperature after
  these processors). Listed last. Key ``sampler_key``; ``records[key]`` is a list by position.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from loadtest.instruments import _RowProcessor
from workers.sampling import apply_moves

KEY = "sampler_key"


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax over the last dimension; -inf entries weigh nothing."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


def dynamic_temperature(logits: torch.Tensor, t: float, spread: float, exponent: float) -> torch.Tensor:
    """llama.cpp's dynamic temperature of each row [rows, vocab] -> [rows]."""
    finite = torch.isfinite(logits).sum(-1).clamp(min=2).float()
    normalized = (_entropy(logits) / finite.log()).clamp(0.0, 1.0)
    t_min, t_max = max(0.0, t - spread), t + spread
    return (t_min + (t_max - t_min) * normalized.pow(exponent)).clamp(min=1e-4)


def mirostat_mask(logits: torch.Tensor, mu: float) -> torch.Tensor:
    """Tokens of one row [vocab] whose surprise -log2 p exceeds ``mu`` (True: masked); never the most likely."""
    surprise = -torch.log_softmax(logits.float(), -1) / math.log(2.0)
    masked = surprise > mu
    masked[int(torch.argmax(logits))] = False
    return masked


def typical_mask(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Tokens of one row [vocab] outside the locally typical set of probability ``mass`` (True: masked)."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    h = -(p * logp.nan_to_num(neginf=0.0)).sum()
    order = torch.argsort((-logp - h).abs())  # -inf logits: infinitely atypical, last
    kept = int((p[order].cumsum(0) < mass).sum()) + 1  # through the token that reaches the mass
    masked = torch.ones_like(logp, dtype=torch.bool)
    masked[order[:kept]] = False
    return masked | torch.isinf(logp)  # rounding can carry the cumulative sum past the finite tokens


class Typical(_RowProcessor):
    def wants(self, cfg: dict[str, Any]) -> bool:
        return "typical_p" in cfg

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (cfg, _) in self.rows.items():
            if index < logits.shape[0]:
                logits[index][typical_mask(logits[index], float(cfg["typical_p"]))] = float("-inf")
        return logits


class DynamicTemperature(_RowProcessor):
    def wants(self, cfg: dict[str, Any]) -> bool:
        return "dynatemp_t" in cfg

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (cfg, _) in self.rows.items():
            if index < logits.shape[0]:
                t = dynamic_temperature(logits[index: index + 1], float(cfg["dynatemp_t"]),
                                        float(cfg.get("dynatemp_range", 0.5 * float(cfg["dynatemp_t"]))),
                                        float(cfg.get("dynatemp_exponent", 1.0)))
                logits[index] /= t[0]
        return logits


class Mirostat2(_RowProcessor):
    # per request key: [mu, log2-probabilities the last step sampled from (or None), positions done]
    state: dict[str, list[Any]] = {}

    def wants(self, cfg: dict[str, Any]) -> bool:
        return "mirostat_tau" in cfg

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (cfg, output_ids) in self.rows.items():
            if index >= logits.shape[0]:
                continue
            tau, eta = float(cfg["mirostat_tau"]), float(cfg.get("mirostat_eta", 0.1))
            state = Mirostat2.state.setdefault(cfg[KEY], [2.0 * tau, None, 0])
            if state[1] is not None and len(output_ids) > state[2]:  # the token the last step sampled
                surprise = -float(state[1][output_ids[-1]])
                state[0] -= eta * (surprise - tau)
            masked = mirostat_mask(logits[index], state[0])
            logits[index][masked] = float("-inf")
            state[1] = torch.log_softmax(logits[index].float(), -1) / math.log(2.0)
            state[2] = len(output_ids)
        return logits


class EntropyRecorder(_RowProcessor):
    records: dict[str, list[float]] = {}

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.temperature: dict[int, float] = {}

    def wants(self, cfg: dict[str, Any]) -> bool:
        return KEY in cfg

    def update_state(self, batch_update: Any) -> None:
        if batch_update is not None:
            for index, params, _prompt, _out in batch_update.added:
                self.temperature[index] = float(params.temperature) if params is not None else 1.0
            apply_moves(self.temperature, batch_update)
        super().update_state(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (cfg, output_ids) in self.rows.items():
            if index >= logits.shape[0]:
                continue
            t = self.temperature.get(index, 1.0)
            h = float(_entropy(logits[index] / t)) if t > 0 else 0.0
            record = EntropyRecorder.records.setdefault(cfg[KEY], [])
            pos = len(output_ids)
            if pos < len(record):
                record[pos] = h  # a step vLLM re-ran at the same position
            else:
                record.extend([math.nan] * (pos - len(record)) + [h])
        return logits
