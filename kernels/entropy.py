"""Entropy estimators of a row of logits (paper §2.1), torch reference implementations.

All three return nats for the distribution softmax(logits) of each row; rows are
independent and ``-inf`` entries (masked tokens) carry zero probability.

* ``exact``: H = -sum p log p over the whole vocabulary.
* ``topk``: H~ = entropy of the distribution renormalized over the top-k tokens.
  H~ <= H always: every tail token is no more likely than the k-th, which bounds the
  tail's share of H from below (derivation in docs/entropy.md).
* ``tail``: H^ = H~ + h(m_tail) + m_tail * log(V_eff - k), the entropy with the tail mass
  spread uniformly over the V_eff - k remaining finite tokens; H <= H^ always. V_eff
  counts finite logits, so masked tokens do not inflate the bound.

``estimate`` picks the Triton kernels for CUDA tensors and the torch path otherwise.
"""
from __future__ import annotations

from enum import Enum

import torch


class Estimator(str, Enum):
    EXACT = "exact"
    TOPK = "topk"
    TAIL = "tail"


def exact_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = log A - sum(e * y) / A with y = z - max(z), e = exp(y), A = sum(e).

    Four passes over the row instead of softmax + entr's six: ~1.0 ms vs ~3.5 ms for
    16 x 49152 float32 rows on two AVX2 cores, which is the difference between ~1% and
    ~3.5% of a decode step there.
    """
    return exact_entropy_and_log_norm(logits)[0]


def exact_entropy_and_log_norm(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, log sum exp z) of each row: the normalizer falls out of the entropy's passes, so a caller that
    also needs probabilities (the stop-token mass) pays no logsumexp pass of its own."""
    z = logits.float()
    peak = z.amax(dim=-1, keepdim=True)
    shifted = z - peak
    shifted.clamp_(min=-1e4)  # masked tokens: exp() is 0 and 0 * shifted stays 0, not nan
    e = shifted.exp()
    total = e.sum(dim=-1)
    log_total = total.log()
    return log_total - torch.linalg.vecdot(e, shifted) / total, log_total + peak.squeeze(-1)


def _binary_entropy(m: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(m) + torch.special.entr(1.0 - m)


def topk_entropies(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H~, H^) of each row from its top-k logits and its full log-sum-exp."""
    z = logits.float()
    k = min(k, z.shape[-1])
    top = z.topk(k, dim=-1).values
    lse_full = torch.logsumexp(z, dim=-1)
    lse_top = torch.logsumexp(top, dim=-1)
    truncated = torch.special.entr(torch.softmax(top, dim=-1)).sum(dim=-1)
    tail_mass = (1.0 - torch.exp(lse_top - lse_full)).clamp(0.0, 1.0)
    n_tail = (torch.isfinite(z).sum(dim=-1) - k).clamp(min=1).float()
    corrected = truncated + _binary_entropy(tail_mass) + tail_mass * torch.log(n_tail)
    return truncated, corrected


def estimate(logits: torch.Tensor, estimator: Estimator | str, k: int = 64) -> torch.Tensor:
    estimator = Estimator(estimator)
    if logits.is_cuda:
        from kernels import entropy_triton

        if estimator is Estimator.EXACT:
            return entropy_triton.exact_entropy(logits)
        truncated, corrected = entropy_triton.topk_entropies(logits, k)
    else:
        if estimator is Estimator.EXACT:
            return exact_entropy(logits)
        truncated, corrected = topk_entropies(logits, k)
    return truncated if estimator is Estimator.TOPK else corrected
