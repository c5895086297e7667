"""Random sampling on CPU by inverse CDF (kernels/csrc/sample.c) in place of vLLM's Gumbel-max, and vLLM's
penalties in C (``sparse_penalties``, kernels/csrc/penalties.c) in place of its whole-batch tensor passes.

vLLM's CPU sampler draws a token by Gumbel-max: a random number and two logs for every token of the
vocabulary, for every row (``torch.ops._C.fused_gumbel_argmax``, vllm 0.32.0), on the engine's one thread,
in every decode step of a sampled batch; what that costs a short-context step is measured in
docs/results/README.md (the inverse-CDF rows). Drawing by inverse CDF takes one exp per token: the same
distribution, softmax of the logits vLLM hands its top-k/top-p stage (after temperature, penalties and every
logits processor, ours included).

Steps where some request sets top-k or top-p take the same draw after the same filter, found without
vLLM's sort of the whole vocabulary (which, for top-p, costs more than a short-context decode step; measured
in docs/results/README.md): each row keeps its tokens with logit >= one threshold, as vLLM's rule does,
except that a tie group at the top-p boundary is kept whole where vLLM's unstable sort keeps an arbitrary
part of it (kernels/csrc/sample.c). Min-p joins that filter too: vLLM applies it as a logits processor just
before its top-k/top-p stage (a softmax, a max and a mask over every row); given that processor, its
``apply`` is taken over here and its rule, x >= max x + ln(min_p), becomes the kernel's floor, where the
row's max is already at hand. Where the kernel does not draw, vLLM's own ``apply`` runs first, as before.

Only where no request of the step has a seed of its own (``generators`` empty: a seeded request keeps
vLLM's seeded stream) and vLLM's float64 Gumbel option is off.
Otherwise, and wherever the kernel declines a batch, vLLM's own path samples it (the kernel writes nothing
into the logits, so vLLM's path gets them as they came). The uniforms come from
torch's default generator, as vLLM's noise does, so a process-wide ``torch.manual_seed`` still fixes them.
"""
from __future__ import annotations

from typing import Any

import torch

from kernels.cpu_penalties import apply_penalties
from kernels.cpu_sample import sample_rows, sample_rows_filtered

_SEED_HIGH = 2**62  # any 64-bit values do: the kernel mixes each seed with SplitMix64


def inverse_cdf_sampling(sampler: Any, logitsprocs: Any = None) -> bool:
    """Route the CPU random draws of ``sampler`` (the model runner's ``Sampler``) through the kernel, where
    they qualify (above), with min-p folded in when ``logitsprocs`` (the input batch's ``LogitsProcessors``)
    is given. False, and nothing changed, where its top-k/top-p stage is not vLLM's CPU path."""
    inner = sampler.topk_topp_sampler
    vllm_forward = inner.forward
    if getattr(vllm_forward, "__func__", None) is not type(inner).forward_cpu:
        return False
    min_p = _foldable_min_p(logitsprocs)
    if min_p is not None:
        min_p.apply = _left_to_the_draw  # on the instance: vLLM's own stays at type(min_p).apply

    def forward(logits: torch.Tensor, generators: dict[int, torch.Generator], k: torch.Tensor | None,
                p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        folded = min_p is not None and bool(min_p.min_p_count)
        mp = min_p.min_p.reshape(-1) if folded else None  # [rows]; vLLM's is [rows, 1]
        if not generators and not inner.use_fp64_gumbel and (mp is None or mp.shape[0] == logits.shape[0]):
            seeds = torch.randint(0, _SEED_HIGH, (logits.shape[0],), dtype=torch.int64)
            if k is None and p is None and mp is None:
                sampled = sample_rows(logits.to(torch.float32), seeds)
                if sampled is not None:
                    return sampled, _processed(logits, inner.logprobs_mode)
            else:
                filtered = sample_rows_filtered(logits.to(torch.float32), seeds, k, p, mp)
                if filtered is not None:
                    sampled, thresholds = filtered
                    if inner.logprobs_mode in ("processed_logits", "processed_logprobs"):
                        logits = logits.masked_fill(logits < thresholds.unsqueeze(1), float("-inf"))
                    return sampled, _processed(logits, inner.logprobs_mode)
        if folded:
            logits = type(min_p).apply(min_p, logits)
        return vllm_forward(logits, generators, k, p)

    inner.forward = forward
    return True


def _foldable_min_p(logitsprocs: Any) -> Any:
    """vLLM's min-p processor where its ``apply`` can move into the draw: the last argmax-invariant processor,
    so that ``Sampler.sample`` calls the top-k/top-p stage right after it (no processor of ours or a user's
    sees the logits in between); else None."""
    if logitsprocs is None:
        return None
    from vllm.v1.sample.logits_processor import MinPLogitsProcessor

    invariant = logitsprocs.argmax_invariant
    if invariant and type(invariant[-1]) is MinPLogitsProcessor:
        return invariant[-1]
    return None


def _left_to_the_draw(logits: torch.Tensor) -> torch.Tensor:
    """The min-p processor's ``apply`` once folded: the draw that follows applies min-p (the kernel's floor, or
    vLLM's ``apply`` where the kernel does not draw)."""
    return logits


def sparse_penalties(sampler: Any) -> None:
    """Apply the repetition, frequency and presence penalties of ``sampler``'s steps with the C kernel
    (kernels/cpu_penalties.py: vLLM's logits bit for bit, touching only each row's prompt and output tokens,
    where vLLM's CPU path builds [rows, vocab] count tensors and passes over every logit several times; what
    that costs a step is measured in docs/results/README.md). vLLM's own path wherever the kernel declines.
    For CPU samplers: the caller installs it where ``inverse_cdf_sampling`` took the sampler."""
    vllm_penalties = sampler.apply_penalties

    def penalties(logits: torch.Tensor, sampling_metadata: Any, output_token_ids: list[list[int]]) -> torch.Tensor:
        m = sampling_metadata
        if m.no_penalties:
            return logits
        if m.prompt_token_ids is not None and apply_penalties(
                logits, m.prompt_token_ids, m.presence_penalties, m.frequency_penalties, m.repetition_penalties,
                output_token_ids):
            return logits
        return vllm_penalties(logits, sampling_metadata, output_token_ids)

    sampler.apply_penalties = penalties


def _processed(logits: torch.Tensor, mode: str) -> torch.Tensor | None:
    """What vLLM's CPU path returns beside the tokens for ``mode``, given the logits after top-k and top-p."""
    if mode == "processed_logits":
        return logits
    if mode == "processed_logprobs":
        return logits.log_softmax(dim=-1, dtype=torch.float32)
    return None
