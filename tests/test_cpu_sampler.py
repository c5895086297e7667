"""Inverse-CDF sampling on CPU (kernels/csrc/sample.c, workers/cpu_sampler.py): draws from the softmax of the
logits it is given, after vLLM's min-p/top-k/top-p rule where asked (boundary ties kept whole), and vLLM's real
Sampler (no model) hands it every unseeded batch, with vLLM's real min-p processor folded into the draw.

Draws use fixed seeds, so every verdict is the same on every run; the frequency tests reject at p < 1e-6 and
show they can reject by failing a distribution a little off the true one with the same draws."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from kernels import cpu_sample
from tests.test_sampler_logprobs import ROWS
from tests.test_sampler_logprobs import _metadata as sampler_metadata

DRAWS = 40_000
NAMED = 24  # tokens counted one by one in the frequency test; the rest of the vocabulary is one more bin


@pytest.fixture(autouse=True)
def _fixed_rng():
    """torch's default generator gives the random logits below and the seeds the Sampler's path draws: fixed, so
    every verdict is the same on every run."""
    torch.manual_seed(1234)


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
    for at in (7, 40, 63):  # a nan among finite logits, in the vector loop and in the tail
        rows = torch.zeros(2, 71)
        rows[1, at] = float("nan")
        assert cpu_sample.sample_rows(rows, seeds) is None, at


# --- vLLM's Sampler with workers.cpu_sampler.inverse_cdf_sampling ----------------------------------------------
VOCAB = 512


@pytest.fixture
def samplers(monkeypatch):
    """(vLLM's Sampler as shipped, one routed through the kernel, the kernel's calls)."""
    from vllm.v1.sample.sampler import Sampler

    import workers.cpu_sampler as module

    calls = []
    plain, filtered = module.sample_rows, module.sample_rows_filtered

    def counting_plain(logits, seeds):
        calls.append(("plain", tuple(logits.shape)))
        return plain(logits, seeds)

    def counting_filtered(logits, seeds, k, p, min_p):
        calls.append(("filtered", tuple(logits.shape)))
        return filtered(logits, seeds, k, p, min_p)

    monkeypatch.setattr(module, "sample_rows", counting_plain)
    monkeypatch.setattr(module, "sample_rows_filtered", counting_filtered)
    ours = Sampler(logprobs_mode="processed_logprobs")
    assert module.inverse_cdf_sampling(ours)
    return Sampler(logprobs_mode="processed_logprobs"), ours, calls


def test_a_plain_batch_is_drawn_by_the_kernel_from_the_tempered_distribution(samplers):
    _, ours, calls = samplers
    logits = torch.randn(ROWS, VOCAB) * 2
    drawn = torch.stack([ours(logits.clone(), sampler_metadata(temperature=0.5)).sampled_token_ids[:, 0].long()
                         for _ in range(5000)])  # [draws, rows]
    assert len(calls) == 5000 and calls[0] == ("plain", (ROWS, VOCAB))
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


def test_seeded_batches_are_left_to_vllm_with_vllms_tokens(samplers):
    shipped, ours, calls = samplers
    logits = torch.randn(ROWS, VOCAB)

    def seeded():
        return {1: torch.Generator().manual_seed(11), 3: torch.Generator().manual_seed(12)}

    for top_p in (None, torch.full((ROWS,), 0.9)):
        torch.manual_seed(3)
        want = shipped(logits.clone(), sampler_metadata(generators=seeded(), top_p=top_p)).sampled_token_ids
        torch.manual_seed(3)
        got = ours(logits.clone(), sampler_metadata(generators=seeded(), top_p=top_p)).sampled_token_ids
        assert torch.equal(got, want)
    assert calls == []


def test_top_k_and_top_p_batches_take_the_filtered_draw_with_vllms_mask_and_processed_logprobs(samplers):
    """float32 normal logits have no ties, so the kernel's threshold must mask what vLLM's sort masks."""
    _, ours, calls = samplers
    logits = torch.randn(ROWS, VOCAB) * 2
    k = torch.tensor([VOCAB, 5, 40, VOCAB], dtype=torch.int32)[:ROWS]
    p = torch.tensor([0.5, 1.0, 0.8, 1.0])[:ROWS]
    meta = sampler_metadata(temperature=0.7, top_k=k, top_p=p, max_num_logprobs=0)
    got = ours(logits.clone(), meta)
    assert calls == [("filtered", (ROWS, VOCAB))]
    tokens = got.sampled_token_ids[:, 0].long()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    masked = apply_top_k_top_p_pytorch(logits / 0.7, k, p)
    assert bool((masked.gather(1, tokens[:, None]) > float("-inf")).all()), "a token outside vLLM's filter"
    want = masked.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(got.logprobs_tensors.logprobs[:, 0], want, atol=1e-5)


def _min_p_processors(values: list[float]):
    """vLLM's ``LogitsProcessors`` holding its real min-p processor, its state set as its engine sets it for
    ``len(values)`` requests with these min_p."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors, MinPLogitsProcessor

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=len(values)))
    processor = MinPLogitsProcessor(config, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(batch_size=len(values), removed=[], moved=[],
                                       added=[(i, SamplingParams(min_p=v), [], []) for i, v in enumerate(values)]))
    return LogitsProcessors([processor])


MIN_P = [0.1, 0.0, 0.3, 0.05]  # one row without min-p


def test_min_p_batches_take_the_filtered_draw_in_place_of_vllms_min_p_pass(samplers):
    """float32 normal logits sit nowhere near the floor, so the kernel must mask what vLLM's min-p and top-k mask
    (the processed logprobs renormalize over the kept set), and vLLM's min-p pass must not run first."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    from vllm.v1.sample.sampler import Sampler

    import workers.cpu_sampler as module

    _, _, calls = samplers
    ours, folded, shipped = Sampler(logprobs_mode="processed_logprobs"), _min_p_processors(MIN_P), _min_p_processors(MIN_P)
    assert module.inverse_cdf_sampling(ours, folded)
    logits = torch.randn(ROWS, VOCAB) * 2
    for k in (None, torch.tensor([VOCAB, 40, VOCAB, 3], dtype=torch.int32)):
        calls.clear()
        meta = sampler_metadata(temperature=0.7, top_k=k, max_num_logprobs=0, logitsprocs=folded)
        got = ours(logits.clone(), meta)
        assert calls == [("filtered", (ROWS, VOCAB))]
        tokens = got.sampled_token_ids[:, 0].long()
        masked = apply_top_k_top_p_pytorch(shipped.argmax_invariant[0].apply(logits / 0.7), k, None)
        assert bool((masked.gather(1, tokens[:, None]) > float("-inf")).all()), "a token outside vLLM's filter"
        want = masked.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        assert torch.allclose(got.logprobs_tensors.logprobs[:, 0], want, atol=1e-5)
        assert int((masked[1] > float("-inf")).sum()) == (VOCAB if k is None else 40), "row 1 has no min-p"


def test_seeded_min_p_batches_are_left_to_vllm_with_its_min_p_applied(samplers):
    """The same tokens as vLLM's own, and the same processed logprobs, which renormalize over min-p's kept set."""
    from vllm.v1.sample.sampler import Sampler

    import workers.cpu_sampler as module

    _, _, calls = samplers
    ours, shipped = Sampler(logprobs_mode="processed_logprobs"), Sampler(logprobs_mode="processed_logprobs")
    folded = _min_p_processors(MIN_P)
    assert module.inverse_cdf_sampling(ours, folded)
    logits = torch.randn(ROWS, VOCAB) * 3
    seeded = {0: torch.Generator().manual_seed(21)}
    torch.manual_seed(5)
    want = shipped(logits.clone(), sampler_metadata(generators=seeded, max_num_logprobs=0,
                                                    logitsprocs=_min_p_processors(MIN_P)))
    seeded = {0: torch.Generator().manual_seed(21)}
    torch.manual_seed(5)
    got = ours(logits.clone(), sampler_metadata(generators=seeded, max_num_logprobs=0, logitsprocs=folded))
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.logprobs_tensors.logprobs, want.logprobs_tensors.logprobs)
    unmasked = torch.log_softmax(logits / 0.5, -1).gather(1, want.sampled_token_ids.long())
    assert not torch.allclose(want.logprobs_tensors.logprobs[:, :1], unmasked, atol=1e-3), "min-p changed nothing"
    assert calls == []


def test_min_p_is_not_folded_where_another_argmax_invariant_processor_follows_it():
    """A user's processor after vLLM's min-p would see the logits before min-p if the draw took it over."""
    from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors
    from vllm.v1.sample.sampler import Sampler

    import workers.cpu_sampler as module

    class UsersInvariantProcessor(LogitsProcessor):  # a stand-in for a plugin's processor: only its place matters
        def __init__(self) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

    min_p = _min_p_processors(MIN_P).argmax_invariant[0]
    assert module.inverse_cdf_sampling(Sampler(), LogitsProcessors([min_p, UsersInvariantProcessor()]))
    assert "apply" not in vars(min_p)
    assert module.inverse_cdf_sampling(Sampler(), LogitsProcessors([min_p]))
    assert min_p.apply is module._left_to_the_draw


# --- min-p, top-k and top-p (entropic_sample_rows_filtered) -----------------------------------------------------
def _rule(row: torch.Tensor, k: int | None, p: float | None, min_p: float | None = None) -> float:
    """The threshold of the kernel's rule, from a full sort in float64: min-p's floor, then vLLM's top-k (ties
    with the k-th kept), then vLLM's top-p over the renormalized rest, a tie group at its boundary kept whole."""
    x = row.double()
    floor = float(x.max()) + math.log(min_p) if min_p else float("-inf")
    desc = torch.sort(x[(x > float("-inf")) & (x >= floor)], descending=True).values
    tau = float("-inf")
    if k is not None and k < desc.numel():
        tau = float(desc[k - 1])
        desc = desc[desc >= tau]
    if p is not None and p < 1:
        values, counts = torch.unique_consecutive(desc, return_counts=True)
        mass = torch.exp(values - values[0]) * counts
        before = torch.cumsum(mass, 0) - mass  # each group's S_greater
        kept = before < p * mass.sum()
        tau = float(values[kept][-1])
    return max(tau, floor)


def _vllm_kept(rows: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    n = rows.shape[0]
    kt = None if k is None else torch.full((n,), k, dtype=torch.int32)
    pt = None if p is None else torch.full((n,), p)
    return apply_top_k_top_p_pytorch(rows.clone(), kt, pt) > float("-inf")


def _filtered(rows: torch.Tensor, k: int | None, p: float | None, seeds: torch.Tensor | None = None,
              min_p: float | None = None):
    n = rows.shape[0]
    got = cpu_sample.sample_rows_filtered(
        rows, torch.arange(n) if seeds is None else seeds, None if k is None else torch.full((n,), k),
        None if p is None else torch.full((n,), p), None if min_p is None else torch.full((n,), min_p))
    assert got is not None
    return got


FILTERS = [(None, 0.9), (None, 0.95), (None, 0.5), (50, None), (1, None), (20, 0.8), (400, 0.99), (None, 1e-4)]


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-rounded"])
@pytest.mark.parametrize("k,p", FILTERS)
def test_the_threshold_is_vllms_filter_with_boundary_ties_kept_whole(real_logits, k, p, bf16):
    """On every position of a real paragraph at two temperatures: vLLM's kept tokens are all kept, and every
    token kept beyond them ties with the threshold (vLLM's unstable sort keeps an arbitrary part of such a
    group); the threshold is the float64 rule's wherever that rule's mass at the boundary is not a rounding
    away from p (bf16-rounded logits, as the engine computes them on bf16 hosts, tie often)."""
    base = real_logits.to(torch.bfloat16).float() if bf16 else real_logits
    for temperature in (0.6, 1.3):
        rows = (base / temperature).contiguous()
        tokens, tau = _filtered(rows, k, p)
        kept = rows >= tau[:, None]
        vllm = _vllm_kept(rows, k, p)
        assert bool((vllm <= kept).all()), "a token vLLM keeps was filtered out"
        extra = kept & ~vllm
        assert bool((rows[extra] == tau.expand_as(rows.T).T[extra]).all()), "a token kept beyond vLLM's off the tie"
        assert bool(kept.gather(1, tokens[:, None]).all())
        rule = torch.tensor([_rule(r, k, p) for r in rows], dtype=torch.float32)
        assert int((rule != tau).sum()) <= 1, (rule, tau)  # one boundary within float rounding at most


MIN_P_FILTERS = [(0.05, None, None), (0.3, None, None), (1.0, None, None), (0.05, 20, None), (0.1, None, 0.8),
                 (0.02, 400, 0.95), (0.5, 3, 0.5), (1e-9, None, 0.9)]


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-rounded"])
@pytest.mark.parametrize("min_p,k,p", MIN_P_FILTERS)
def test_min_p_is_vllms_floor_under_the_threshold(real_logits, min_p, k, p, bf16):
    """vLLM's min-p processor, then its top-k/top-p, on every position of a real paragraph at two temperatures:
    the tokens kept differ from vLLM's only at the floor within float rounding (vLLM compares probabilities,
    the kernel logits) or, beyond vLLM's, tied with the threshold at the top-p boundary."""
    base = real_logits.to(torch.bfloat16).float() if bf16 else real_logits
    for temperature in (0.6, 1.3):
        rows = (base / temperature).contiguous()
        n = rows.shape[0]
        tokens, tau = _filtered(rows, k, p, min_p=min_p)
        kept = rows >= tau[:, None]
        vllm = _vllm_kept(_min_p_processors([min_p] * n).argmax_invariant[0].apply(rows.clone()), k, p)
        floor = rows.max(-1, keepdim=True).values + math.log(min_p)
        near_floor = (rows - floor).abs() <= 1e-5 * floor.abs().clamp_min(1.0)
        assert bool((vllm <= (kept | near_floor)).all()), "a token vLLM keeps was filtered out"
        assert bool((kept <= (vllm | near_floor | (rows == tau[:, None]))).all()), "a token kept beyond vLLM's"
        assert bool(kept.gather(1, tokens[:, None]).all())
        rule = torch.tensor([_rule(r, k, p, min_p) for r in rows.double()], dtype=torch.float64)
        differ = (rows.double() >= rule[:, None]) != kept  # the floor is no logit: compare the kept sets
        assert int(differ.any(-1).sum()) <= 1, differ.nonzero()  # one boundary within float rounding at most


def test_filtered_draws_follow_the_renormalized_kept_distribution(real_logits):
    row = real_logits[5].contiguous()
    for k, p, min_p in ((None, 0.9, None), (30, None, None), (30, 0.95, None), (None, None, 0.02), (None, 0.9, 0.05)):
        rows = row.expand(1000, -1).contiguous()
        tokens = torch.cat([_filtered(rows, k, p, torch.arange(s, s + 1000), min_p)[0]
                            for s in range(0, DRAWS, 1000)])
        tau = _rule(row, k, p, min_p)
        target = row.masked_fill(row < tau, float("-inf"))
        assert int((row >= tau).sum()) > 3, "the filter must leave something to test"
        assert _chi2_p(tokens, target) > 1e-6
        assert bool((row[tokens] >= tau).all())
        assert _chi2_p(tokens, row) < 1e-6, "the same draws cannot tell the filtered distribution from the whole"


def test_filtered_edge_rows():
    vocab = 3000
    rows = torch.full((6, vocab), float("-inf"))
    rows[0, :10] = torch.arange(10.0)            # k beyond the finite tokens: all ten kept, as vLLM keeps them
    rows[1] = torch.linspace(-2000.0, 0.0, vocab)  # k deep below the max: the exact k-th logit, however far
    rows[2, [4, 9, 2999]] = 1.0                  # k = 1 with a three-way tie at the top: all three kept
    rows[3] = torch.randn(vocab)                 # top-k and top-p off in this row: a plain draw, threshold -inf
    rows[4, :] = 0.0                             # every token ties: top-p keeps them all
    rows[5] = torch.randn(vocab)                 # p tiny: the max alone
    k = torch.tensor([50, 2500, 1, vocab, vocab, 0])
    p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.3, 1e-6])
    tokens, tau = cpu_sample.sample_rows_filtered(rows, torch.arange(6), k, p)
    assert float(tau[0]) == float("-inf") and int(tokens[0]) < 10
    assert float(tau[1]) == float(rows[1, vocab - 2500]) and int(tokens[1]) >= vocab - 2500
    assert float(tau[2]) == 1.0 and int(tokens[2]) in (4, 9, 2999)
    assert float(tau[3]) == float("-inf")
    assert float(tau[4]) == 0.0
    assert int(tokens[5]) == int(rows[5].argmax()) and float(tau[5]) == float(rows[5].max())
    vllm = _vllm_kept(rows[1:2], 2500, None)
    assert torch.equal(vllm[0], rows[1] >= tau[1])


def test_the_filtered_kernel_declines_what_it_cannot_draw_from():
    rows = torch.randn(2, 64)
    rows[1, 3] = float("nan")
    assert cpu_sample.sample_rows_filtered(rows, torch.arange(2), None, torch.full((2,), 0.9)) is None
    assert cpu_sample.sample_rows_filtered(rows, torch.arange(2), None, None, torch.full((2,), 0.1)) is None
    assert cpu_sample.sample_rows_filtered(rows[:1], torch.arange(1), torch.full((2,), 5), None) is None
    assert cpu_sample.sample_rows_filtered(rows[:1], torch.arange(1), None, None, torch.full((2,), 0.1)) is None
    assert cpu_sample.sample_rows_filtered(rows[:1], torch.arange(1), None, None, torch.full((1,), 1.5)) is None
