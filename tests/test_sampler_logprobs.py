"""vLLM's real Sampler (no model) with workers.engine.processed_logprobs_only_when_asked: processed logprobs are
computed in steps whose batch asked for them, and only there; tokens and logprobs are vLLM's."""
from __future__ import annotations

import pytest
import torch

ROWS, VOCAB = 4, 512


def _metadata(max_num_logprobs: int | None = None, temperature: float = 0.5, generators: dict | None = None,
              top_p: torch.Tensor | None = None, top_k: torch.Tensor | None = None, penalties: dict | None = None,
              logitsprocs=None):
    """An all-random batch of ROWS rows, for vLLM's real Sampler (tests/test_cpu_sampler.py and
    tests/test_cpu_penalties.py too); temperature 0: all greedy. ``penalties``: SamplingMetadata's penalty
    fields (prompt_token_ids, the three penalties, output_token_ids), else none; ``logitsprocs``: vLLM's
    ``LogitsProcessors``, else none."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    empty = torch.zeros(ROWS)
    fields = {"no_penalties": True, "prompt_token_ids": None, "frequency_penalties": empty,
              "presence_penalties": empty, "repetition_penalties": torch.ones(ROWS),
              "output_token_ids": [[] for _ in range(ROWS)]}
    if penalties is not None:
        fields.update(penalties, no_penalties=False)
    greedy = temperature == 0
    return SamplingMetadata(
        temperature=None if greedy else torch.full((ROWS,), temperature), all_greedy=greedy, all_random=not greedy,
        top_p=top_p, top_k=top_k, generators=generators or {}, max_num_logprobs=max_num_logprobs,
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors() if logitsprocs is None else logitsprocs, **fields)


@pytest.fixture
def sampler_and_log_softmax_calls(monkeypatch):
    from vllm.v1.sample.sampler import Sampler

    from workers.engine import processed_logprobs_only_when_asked

    calls = []
    log_softmax = torch.Tensor.log_softmax

    def counting(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return log_softmax(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "log_softmax", counting)
    sampler = Sampler(logprobs_mode="processed_logprobs")
    processed_logprobs_only_when_asked(sampler)
    return sampler, calls


def test_a_batch_that_asked_for_no_logprobs_pays_no_log_softmax(sampler_and_log_softmax_calls):
    sampler, calls = sampler_and_log_softmax_calls
    out = sampler(torch.randn(ROWS, VOCAB), _metadata(max_num_logprobs=None))
    assert out.logprobs_tensors is None and out.sampled_token_ids.shape == (ROWS, 1)
    assert calls == []


def test_a_batch_that_asked_gets_the_logprobs_of_the_distribution_it_sampled_from(sampler_and_log_softmax_calls):
    sampler, calls = sampler_and_log_softmax_calls
    logits = torch.randn(ROWS, VOCAB)
    sampler(logits.clone(), _metadata(max_num_logprobs=None))  # a step that did not ask changes nothing after it
    out = sampler(logits.clone(), _metadata(max_num_logprobs=0, temperature=0.5))
    assert calls == [(ROWS, VOCAB)]
    tokens = out.sampled_token_ids[:, 0].long()
    want = torch.log_softmax(logits / 0.5, dim=-1).gather(1, tokens[:, None])[:, 0]
    got = out.logprobs_tensors.logprobs[:, 0]  # the sampled token's logprob comes first
    assert torch.allclose(got, want, atol=1e-5)
