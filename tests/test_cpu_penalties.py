"""vLLM's penalties in one C call (kernels/csrc/penalties.c, workers/cpu_sampler.sparse_penalties): the logits
vLLM's own ``apply_all_penalties`` gives, bit for bit, on random batches built to hit every case (prompt
padding, vLLM's -1 placeholders, repeated tokens, logits of either sign and zero, rows without penalties,
strided rows) and on real model logits; and vLLM's real Sampler routes its penalties through the kernel."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_penalties
from tests.test_sampler_logprobs import ROWS
from tests.test_sampler_logprobs import _metadata as sampler_metadata


def _vllm(logits, prompt, presence, frequency, repetition, outputs):
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    return apply_all_penalties(logits.clone(), prompt, presence, frequency, repetition, [list(o) for o in outputs])


def _case(seed: int, rows: int, vocab: int, logits: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    if logits is None:
        logits = torch.randn(rows, vocab, generator=g) * 3
        logits[0, :50] = 0.0  # zeros take the "not > 0" side
    hot = min(vocab, 200)  # a small range of ids, so prompts and outputs repeat tokens and overlap
    prompt = torch.randint(0, hot, (rows, 40), generator=g)
    prompt[1, 10:] = vocab  # vLLM pads shorter prompts with vocab
    outputs = [torch.randint(0, hot, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    outputs[-1] = outputs[-1] + [-1]  # async scheduling's placeholder for a token not yet known
    presence = torch.rand(rows, generator=g) * 2 - 0.5
    frequency = torch.rand(rows, generator=g) * 2 - 0.5
    repetition = 0.5 + torch.rand(rows, generator=g) * 1.5
    presence[2], frequency[2], repetition[2] = 0.0, 0.0, 1.0  # a row without penalties in a batch with them
    return logits, prompt, presence, frequency, repetition, outputs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_gives_vllms_penalized_logits_bit_for_bit(seed):
    logits, *args = _case(seed, rows=5, vocab=1000 + seed)
    want = _vllm(logits, *args)
    got = logits.clone()
    assert cpu_penalties.apply_penalties(got, *args)
    assert not _same_bits(got, logits), "nothing was penalized: the case tests nothing"
    assert _same_bits(got, want)


def test_real_logits_and_strided_rows(real_logits):
    rows = real_logits[:ROWS]
    wide = torch.zeros(ROWS, rows.shape[1] + 7)
    wide[:, :rows.shape[1]] = rows
    view = wide[:, :rows.shape[1]]  # rows of stride vocab + 7
    _, *args = _case(11, rows=ROWS, vocab=rows.shape[1], logits=rows)
    want = _vllm(rows, *args)
    assert cpu_penalties.apply_penalties(view, *args)
    assert _same_bits(view, want)
    assert bool((wide[:, rows.shape[1]:] == 0).all()), "the kernel wrote past a row"


def test_the_kernel_declines_what_it_does_not_read_and_leaves_the_logits_alone():
    logits, prompt, presence, frequency, repetition, outputs = _case(3, rows=3, vocab=300)
    before = logits.clone()
    assert not cpu_penalties.apply_penalties(logits.double(), prompt, presence, frequency, repetition, outputs)
    assert not cpu_penalties.apply_penalties(logits, prompt.int(), presence, frequency, repetition, outputs)
    assert not cpu_penalties.apply_penalties(logits, prompt, presence.double(), frequency, repetition, outputs)
    assert not cpu_penalties.apply_penalties(logits, prompt, presence, frequency, repetition, outputs[:2])
    assert _same_bits(logits, before)


def test_vllms_sampler_applies_penalties_through_the_kernel(monkeypatch):
    """Greedy, so both samplers' tokens are determined: with the penalties routed through the kernel the tokens
    and the processed logprobs are vLLM's."""
    from vllm.v1.sample.sampler import Sampler

    import workers.cpu_sampler as module

    calls = []
    kernel = module.apply_penalties
    monkeypatch.setattr(module, "apply_penalties", lambda *a: calls.append(1) or kernel(*a))
    shipped, ours = Sampler(logprobs_mode="processed_logprobs"), Sampler(logprobs_mode="processed_logprobs")
    assert module.inverse_cdf_sampling(ours)
    module.sparse_penalties(ours)
    logits, prompt, presence, frequency, repetition, outputs = _case(5, rows=ROWS, vocab=512)
    logits[:, :200] += 4.0  # the penalized ids lead, so penalties decide the argmax
    fields = {"prompt_token_ids": prompt, "presence_penalties": presence, "frequency_penalties": frequency,
              "repetition_penalties": repetition, "output_token_ids": outputs}
    want = shipped(logits.clone(), sampler_metadata(temperature=0, max_num_logprobs=1, penalties=fields))
    got = ours(logits.clone(), sampler_metadata(temperature=0, max_num_logprobs=1, penalties=fields))
    assert calls == [1]
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.logprobs_tensors.logprobs, want.logprobs_tensors.logprobs)
    plain = shipped(logits.clone(), sampler_metadata(temperature=0))
    assert not torch.equal(plain.sampled_token_ids, want.sampled_token_ids), "the penalties changed no token"
