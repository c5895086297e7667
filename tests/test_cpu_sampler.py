"""Inverse-CDF sampling on CPU (kernels/csrc/sample.c, workers/cpu_sampler.py): draws from the softmax of the
logits it is given, and vLLM's real Sampler (no model) hands it exactly the batches where vLLM's Gumbel-max
would have drawn plainly.

Draws use fixed seeds, so every verdict is the same on every run; the frequency tests reject at p < 1e-6 and
show they can reject by failing a distribution a little off the true one with the same draws."""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from kernels import cpu_sample
from tests.test_sampler_logprobs import ROWS
from tests.test_sampler_logprobs import _metadata as sampler_metadata

DRAWS = 40_000
NAMED = 24  # tokens counted one by one in the frequency test; the rest of the vocabulary is one more bin


def _draw(row: torch.Tensor, draws: int = DRAWS, first_seed: int = 0) -> torch.Tensor:
    """``draws`` tokens from one logits row, each with its own seed, in batches of 1000 rows."""
    out, rows = [], row.expand(1000, -1).contiguous()
    for start in range(0, draws, 1000):
        n = min(1000, draws - start)
        got = cpu_sample.sample_rows(rows[:n], torch.arange(first_seed + start, first_seed + start + n))
        assert got is not None
        out.append(got)
    return torch.cat(out)


def _chi2_p(tokens: torch.Tensor, logits: torch.Tensor) -> float:
    """p-value of the draws under softmax(logits): the NAMED likeliest tokens one by one, the rest together."""
    p = torch.softmax(logits.double(), -1)
    top = torch.topk(p, NAMED).indices
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    observed = torch.cat([counts[top], (counts.sum() - counts[top].sum()).unsqueeze(0)])
    expected = torch.cat([p[top], (1 - p[top].sum()).clamp_min(0).unsqueeze(0)]) * tokens.numel()
    keep = expected > 5  # the chi-square approximation needs it; tiny bins carry nothing here
    return float(stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue)


def test_the_kernel_builds_here():
    assert cpu_sample.load() is not None, "the C kernel must build where the tests run (a C compiler is needed)"


@pytest.mark.parametrize("scale", [1 / 0.7, 1.0, 1 / 1.5])
def test_draws_follow_the_softmax_of_real_logits(real_logits, scale):
    row = (real_logits[0] * scale).contiguous()
    tokens = _draw(row)
    assert _chi2_p(tokens, row) > 1e-6
    assert _chi2_p(tokens, row * 1.1) < 1e-6, "the test cannot tell a 10% sharper distribution from this one"


def test_masked_tokens_are_never_drawn_and_a_vocabulary_off_the_block_size_is_read_to_its_end():
    logits = torch.full((49_157,), float("-inf"))  # 49157 = 16 * 3072 + 5: a partial last block
    live = torch.tensor([3, 17, 4_000, 49_152, 49_156])
    logits[live] = torch.tensor([0.5, -1.0, 2.0, 1.0, 0.0])
    tokens = _draw(logits, draws=20_000)
    assert set(tokens.unique().tolist()) == set(live.tolist())
    assert _chi2_p(tokens, logits) > 1e-6


def test_a_row_with_one_live_token_always_draws_it_and_rows_of_a_batch_are_drawn_apart():
    logits = torch.full((3, 1000), float("-inf"))
    logits[0, 999] = 0.0
    logits[1, 0] = 5.0
    logits[2] = 0.0  # uniform
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    drawn = cpu_sample.sample_rows(logits, seeds)
    assert drawn is not None and drawn[:2].tolist() == [999, 0] and 0 <= int(drawn[2]) < 1000
    assert torch.equal(cpu_sample.sample_rows(logits, seeds), drawn), "equal seeds, equal draws"


def test_strided_rows_are_read_as_rows():
    wide = torch.full((2, 600), 50.0)  # columns past 500 would win every draw if they were read
    wide[:, :500] = torch.randn(2, 500)
    tokens = cpu_sample.sample_rows(wide[:, :500], torch.tensor([5, 6], dtype=torch.int64))
    assert tokens is not None and bool((tokens < 500).all())


def test_the_kernel_declines_what_it_cannot_draw_from():
    seeds = torch.zeros(2, dtype=torch.int64)
    fine = torch.zeros(2, 64)
    assert cpu_sample.sample_rows(fine.double(), seeds) is None
    assert cpu_sample.sample_rows(fine, seeds.int()) is None
    for bad in (float("-inf"), float("inf"), float("nan")):
        rows = fine.clone()
        rows[1, :] = float("-inf")
        rows[1, 7] = bad
        assert cpu_sample.sample_rows(rows, seeds) is None, bad


# --- vLLM's Sampler with workers.cpu_sampler.inverse_cdf_sampling ----------------------------------------------
VOCAB = 512


@pytest.fixture
def samplers(monkeypatch):
    """(vLLM's Sampler as shipped, one routed through the kernel, the kernel's calls)."""
    from vllm.v1.sample.sampler import Sampler

    import workers.cpu_sampler as module

    calls = []
    kernel = module.sample_rows

    def counting(logits, seeds):
        calls.append(tuple(logits.shape))
        return kernel(logits, seeds)

    monkeypatch.setattr(module, "sample_rows", counting)
    ours = Sampler(logprobs_mode="processed_logprobs")
    assert module.inverse_cdf_sampling(ours)
    return Sampler(logprobs_mode="processed_logprobs"), ours, calls


def test_a_plain_batch_is_drawn_by_the_kernel_from_the_tempered_distribution(samplers):
    _, ours, calls = samplers
    logits = torch.randn(ROWS, VOCAB) * 2
    drawn = torch.stack([ours(logits.clone(), sampler_metadata(temperature=0.5)).sampled_token_ids[:, 0].long()
                         for _ in range(5000)])  # [draws, rows]
    assert len(calls) == 5000 and calls[0] == (ROWS, VOCAB)
    for r in range(ROWS):
        assert _chi2_p(drawn[:, r], logits[r] / 0.5) > 1e-6
        assert _chi2_p(drawn[:, r], logits[r]) < 1e-6, "temperature 0.5 was not applied before the draw"


def test_the_kernel_path_returns_the_processed_logprobs_vllm_would(samplers):
    _, ours, _ = samplers
    logits = torch.randn(ROWS, VOCAB)
    out = ours(logits.clone(), sampler_metadata(temperature=0.5, max_num_logprobs=0))
    tokens = out.sampled_token_ids[:, 0].long()
    want = torch.log_softmax(logits / 0.5, dim=-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(out.logprobs_tensors.logprobs[:, 0], want, atol=1e-5)


def test_seeded_and_top_p_batches_are_left_to_vllm_with_vllms_tokens(samplers):
    shipped, ours, calls = samplers
    logits = torch.randn(ROWS, VOCAB)

    def seeded():
        return {1: torch.Generator().manual_seed(11), 3: torch.Generator().manual_seed(12)}

    for meta in (lambda: sampler_metadata(generators=seeded()), lambda: sampler_metadata(top_p=torch.full((ROWS,), 0.9))):
        torch.manual_seed(3)
        want = shipped(logits.clone(), meta()).sampled_token_ids
        torch.manual_seed(3)
        got = ours(logits.clone(), meta()).sampled_token_ids
        assert torch.equal(got, want)
    assert calls == []
