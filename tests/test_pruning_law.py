"""Pruning budget law, block scoring and selection (pure; torch reference and Triton under the interpreter)."""
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from controller.laws.pruning import PruningLaw, blocks_to_keep, next_keep_fraction, target_keep_fraction
from kernels.block_select import block_scores, pack_summaries, select_blocks, selection_bias, summarize_blocks

ROOT = Path(__file__).resolve().parent.parent


def test_low_entropy_prunes_hard_high_entropy_attends_everything():
    law = PruningLaw(budget="entropy", keep_min=0.2, entropy_low=0.5, entropy_high=2.5)
    assert target_keep_fraction(0.1, law) == pytest.approx(0.2)
    assert target_keep_fraction(3.0, law) == 1.0
    assert target_keep_fraction(1.5, law) == pytest.approx(0.6)
    assert target_keep_fraction(math.nan, law) == 1.0  # no estimate yet


def test_entropy_floor_and_error_bound_make_pruning_conservative():
    plain = PruningLaw(budget="entropy", keep_min=0.2, entropy_low=0.5, entropy_high=2.5)
    floored = PruningLaw(budget="entropy", keep_min=0.2, entropy_low=0.5, entropy_high=2.5, entropy_min=1.5)
    widened = PruningLaw(budget="entropy", keep_min=0.2, entropy_low=0.5, entropy_high=2.5, epsilon_h=1.0)
    # an overconfident estimate (0.0) cannot push the floored law below f(H_min)
    assert target_keep_fraction(0.0, floored) == pytest.approx(target_keep_fraction(1.5, plain))
    assert target_keep_fraction(0.5, widened) == pytest.approx(target_keep_fraction(1.5, plain))
    for h in (0.0, 0.7, 1.9, 4.0):
        assert target_keep_fraction(h, floored) >= target_keep_fraction(h, plain)
        assert target_keep_fraction(h, widened) >= target_keep_fraction(h, plain)


def test_rate_of_change_is_bounded_and_starts_dense():
    law = PruningLaw(budget="entropy", keep_min=0.1, max_step=0.2)
    f = None
    seen = []
    for _ in range(6):
        f = next_keep_fraction(f, 0.0, law)
        seen.append(f)
    assert seen[0] == pytest.approx(0.8)  # from 1.0, one step
    assert all(abs(a - b) <= 0.2 + 1e-12 for a, b in zip([1.0] + seen, seen))
    assert seen[-1] == pytest.approx(0.1)
    assert next_keep_fraction(0.1, 10.0, law) == pytest.approx(0.3)


def test_fixed_budget_keeps_its_fraction_from_the_first_step_whatever_the_entropy():
    law = PruningLaw(budget="fixed", keep_min=0.3, max_step=0.1)
    f = None
    for h in (math.nan, 0.0, 5.0, 0.2, 12.0):
        f = next_keep_fraction(f, h, law)
        assert f == 0.3 and target_keep_fraction(h, law) == 0.3
    assert blocks_to_keep(40, 5000, f, law) == 12
    with pytest.raises(ValueError):
        PruningLaw(budget="adaptive")  # type: ignore[arg-type]


def test_block_budget_guards():
    law = PruningLaw(min_blocks=4, min_context_tokens=1024)
    assert blocks_to_keep(40, 5000, 0.01, law) == 4  # B_min
    assert blocks_to_keep(40, 5000, 0.5, law) == 20
    assert blocks_to_keep(40, 5000, 1.0, law) == 40
    assert blocks_to_keep(6, 700, 0.1, law) == 6  # short context stays dense
    assert blocks_to_keep(2, 5000, 0.1, PruningLaw(min_context_tokens=0)) == 2
    with pytest.raises(ValueError):
        PruningLaw(min_blocks=1)


def _brute_scores(q, kmin, kmax, scale, log_info):
    # q [P, KVH, G, D]; per block: max over heads of sum_c max(q kmax, q kmin)
    prod = torch.maximum(q[:, None] * kmax[:, :, :, None], q[:, None] * kmin[:, :, :, None]).sum(-1)
    return prod.flatten(2).amax(-1) * scale + log_info


def test_matmul_form_equals_the_per_channel_bound():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 4, 16)
    a, b = torch.randn(2, 30, 16), torch.randn(2, 30, 16)  # kv heads, physical blocks, channels
    summaries = pack_summaries(torch.minimum(a, b), torch.maximum(a, b))
    physical = torch.randint(0, 30, (3, 10))  # each row's logical blocks
    info = torch.randn(3, 10)
    got = block_scores(q, summaries, physical, 0.125, info)
    kmin = torch.minimum(a, b)[:, physical].permute(1, 2, 0, 3)  # [P, W, KVH, D]
    kmax = torch.maximum(a, b)[:, physical].permute(1, 2, 0, 3)
    assert torch.allclose(got, _brute_scores(q, kmin, kmax, 0.125, info), atol=1e-5)


def test_bound_is_an_upper_bound_of_every_token_logit():
    torch.manual_seed(1)
    keys = torch.randn(8, 2, 32, 16)  # blocks, kv heads, tokens, channels
    summaries = torch.empty(2, 8, 32)  # kv heads, blocks, (max | min)
    summarize_blocks(keys, torch.arange(8), summaries)
    assert torch.equal(summaries[..., 16:], keys.amin(2).transpose(0, 1))
    assert torch.equal(summaries[..., :16], keys.amax(2).transpose(0, 1))
    q = torch.randn(1, 2, 3, 16)
    scores = block_scores(q, summaries, torch.arange(8)[None], 1.0)
    logits = torch.einsum("kgd,bktd->bkgt", q[0], keys)  # every q.k
    assert bool((logits.flatten(1).amax(1) <= scores[0] + 1e-4).all())


def test_summaries_of_tile_packed_keys_equal_those_of_plain_keys():
    """A cache that packs keys in tiles ([blocks, KVH, groups, tokens, channel groups, channels], as
    vLLM's AMX layout is read) gives the same summaries as the same keys laid out plainly."""
    torch.manual_seed(2)
    keys = torch.randn(6, 2, 64, 32)  # blocks, kv heads, tokens, channels
    packed = keys.view(6, 2, 4, 16, 16, 2).transpose(3, 4).contiguous().transpose(3, 4)  # strided like the view
    assert not packed.is_contiguous()
    ids = torch.tensor([1, 4, 5])
    want, got = torch.zeros(2, 6, 64), torch.zeros(2, 6, 64)
    summarize_blocks(keys, ids, want)
    summarize_blocks(packed, ids, got)
    assert torch.equal(got, want) and bool(want[:, ids].abs().sum(-1).gt(0).all())


def test_selection_keeps_sink_and_current_block_in_order():
    scores = torch.tensor([[0.0, 5.0, 1.0, 9.0, 2.0, -1.0, 0.0, 0.0],
                           [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    num_blocks = torch.tensor([6, 4])
    keep = torch.tensor([4, 2])
    biased = scores + selection_bias(num_blocks, 8)
    chosen = select_blocks(biased, keep)
    assert chosen[0].tolist() == [0, 1, 3, 5]  # sink, two best middle blocks, current block last
    assert chosen[1, :2].tolist() == [0, 3]
    full = select_blocks(scores[:1] + selection_bias(torch.tensor([6]), 8), torch.tensor([6]))
    assert full[0].tolist() == list(range(6))


def test_block_information_follows_each_added_surprisal():
    """log S_b, kept current incrementally across steps, equals the per-block formula recomputed from scratch."""
    from workers.pruning_state import RequestPruning

    def reference(track: RequestPruning, n: int, bs: int) -> list[float]:
        mean = track.surprisal_total / track.surprisal_count
        out = []
        for b in range(n):
            known = track.known_tokens[b] if b < len(track.known_tokens) else 0
            total = track.block_surprisal[b] if b < len(track.block_surprisal) else 0.0
            out.append(math.log(max(total + (bs - known) * mean, 1e-6)))
        return out

    gen = torch.Generator().manual_seed(0)
    track, bs = RequestPruning.from_args({}), 4
    assert track.log_info(3, bs) is None  # nothing known yet
    track.add_surprisal(0, [float(v) for v in torch.rand(9, generator=gen)] + [None, float("nan")], bs)
    position = 11
    for step in range(12):  # decode: one token a step, crossing block ends; asked for more blocks than known
        n = position // bs + 1 + step % 3
        got = track.log_info(n, bs)
        assert got is not None and got.dtype == torch.float64
        assert got.tolist() == pytest.approx(reference(track, n, bs), rel=1e-12, abs=1e-12)
        track.add_surprisal(position, [float(torch.rand(1, generator=gen)) * 5], bs)
        position += 1
    track.add_surprisal(2, [0.0], bs)  # a late value for an early block reaches the cached rows too
    assert track.log_info(4, bs).tolist() == pytest.approx(reference(track, 4, bs), rel=1e-12, abs=1e-12)


# group: query heads per KV head; 1-8 take the kernel's unrolled paths, 12 its general loop; the query is
# read in place from a layer's [tokens, heads, D] query (float32 or bf16, rows strided as a slice of vLLM's qkv;
# a bf16 query with bf16 summaries takes the AVX512-BF16 scoring on CPUs that have it, the float one elsewhere);
# the summaries are in the cache's dtype (float32 or bf16)
@pytest.mark.parametrize("seed,group,dtype,summary_dtype", [
    (0, 3, torch.float32, torch.float32), (1, 3, torch.bfloat16, torch.bfloat16),
    (2, 3, torch.float32, torch.float32), (3, 1, torch.bfloat16, torch.bfloat16),
    (4, 8, torch.float32, torch.float32), (5, 12, torch.float32, torch.float32),
    (6, 3, torch.bfloat16, torch.float32), (7, 12, torch.bfloat16, torch.bfloat16),
    (8, 5, torch.bfloat16, torch.bfloat16)])
def test_fused_cpu_selection_matches_the_torch_path(seed, group, dtype, summary_dtype):
    from kernels.cpu_select import load, select_into_table

    assert load() is not None, "the fused selection library must build here (cc is part of the toolchain)"
    gen = torch.Generator().manual_seed(seed)
    rows, kv_heads, d, pool, width = 5, 3, 64, 300, 57
    summaries = torch.randn(kv_heads, pool, 2 * d, generator=gen).to(summary_dtype)
    nblocks = torch.randint(8, width + 1, (rows,), generator=gen)
    physical = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in range(rows)])
    keep = torch.minimum(torch.randint(2, 20, (rows,), generator=gen), nblocks)
    bias = selection_bias(nblocks, width, torch.randn(rows, width, generator=gen))
    heads = kv_heads * group
    qkv = torch.randn(11, heads + 2 * kv_heads, d, generator=gen).to(dtype)
    query = qkv[:, :heads]  # a slice of the fused projection: token rows strided, heads and channels contiguous
    tokens = torch.tensor([9, 2, 0, 5, 10])
    q = query.index_select(0, tokens).float().view(rows, kv_heads, group, d)
    table_rows = torch.tensor([7, 0, 3, 9, 4])
    table = torch.full((10, 80), -1, dtype=torch.int32)
    assert select_into_table(query, tokens, summaries, physical, bias, keep, 0.125, table, table_rows)
    want = physical.gather(1, select_blocks(block_scores(q, summaries, physical, 0.125, bias), keep))
    for p in range(rows):
        k = int(keep[p])
        assert table[table_rows[p], :k].tolist() == want[p, :k].tolist()
        assert table[table_rows[p], 0] == physical[p, 0] and table[table_rows[p], k - 1] == physical[p, nblocks[p] - 1]
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[table_rows] = False
    assert (table[untouched] == -1).all()
    # rows spread over two engine threads (OpenMP builds) choose the same blocks
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spread = torch.full((10, 80), -1, dtype=torch.int32)
        assert select_into_table(query, tokens, summaries, physical, bias, keep, 0.125, spread, table_rows)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(spread, table)


@pytest.mark.parametrize("isa,dtype,block_size", [("vec", torch.float32, 64), ("vec", torch.bfloat16, 64),
                                                  ("vec", torch.float32, 40), ("amx", torch.bfloat16, 64),
                                                  ("amx", torch.bfloat16, 32)])
def test_c_key_summaries_match_the_torch_path(isa, dtype, block_size):
    from kernels.cpu_summary import load, summarize_into
    from workers.pruned_attention import key_cache_view

    assert load() is not None, "the key-summary library must build here (cc is part of the toolchain)"
    gen = torch.Generator().manual_seed(block_size)
    blocks, kv_heads, d = 30, 3, 64
    cache = torch.randn(blocks, kv_heads, block_size, 2 * d, generator=gen).to(dtype)
    ids = torch.tensor([0, 7, 3, 29, 12])
    # in the cache's dtype, as the backend keeps them: the extremes of its values are exact there
    want = torch.zeros(kv_heads, blocks, 2 * d, dtype=dtype)
    got = torch.full((kv_heads, blocks, 2 * d), 99.0, dtype=dtype)
    summarize_blocks(key_cache_view(cache, isa), ids, want)
    assert summarize_into(cache, isa, ids, got)
    assert torch.equal(got[:, ids], want[:, ids])
    if isa == "vec":  # nothing rounded: the float32 extremes of the keys, exactly
        keys = key_cache_view(cache, isa).float()[ids]  # [blocks, KV heads, tokens, channels]
        assert torch.equal(got[:, ids, :d].float(), keys.amax(dim=2).transpose(0, 1))
        assert torch.equal(got[:, ids, d:].float(), keys.amin(dim=2).transpose(0, 1))
    others = torch.ones(blocks, dtype=torch.bool)
    others[ids] = False
    assert bool((got[:, others] == 99.0).all()), "only the listed blocks are written"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # blocks spread over two engine threads (OpenMP builds): the same summaries
    try:
        spread = torch.full_like(got, 99.0)
        assert summarize_into(cache, isa, ids, spread)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(spread, got)


def test_c_key_summaries_decline_what_they_do_not_read():
    from kernels.cpu_summary import summarize_into

    summaries = torch.zeros(2, 4, 32)
    ids = torch.tensor([1])
    assert not summarize_into(torch.zeros(4, 2, 32, 32, dtype=torch.float16), "vec", ids, summaries)  # dtype
    assert not summarize_into(torch.zeros(4, 2, 32, 32), "amx", ids, summaries)  # AMX tiles are bf16 only
    assert not summarize_into(torch.zeros(4, 2, 32, 32), "neon", ids, summaries)  # layout
    assert not summarize_into(torch.zeros(4, 2, 32, 32), "vec", torch.tensor([4]), summaries)  # block out of range
    assert not summarize_into(torch.zeros(4, 2, 32, 32, dtype=torch.bfloat16), "vec", ids, summaries)  # not its dtype
    assert bool((summaries == 0).all())


def test_triton_kernels_match_torch_under_interpreter(tmp_path):
    # The interpreter must be chosen before triton is imported: run in a fresh process.
    script = textwrap.dedent("""
        import torch
        from kernels import block_select, block_select_triton
        torch.manual_seed(0)
        cache = torch.randn(12, 3, 64, 2 * 32)  # blocks, kv heads, block_size, 2 * head_dim (CPU layout)
        keys = cache.view(12, 3, 2 * 64 * 32)[:, :, :64 * 32].view(12, 3, 32, 64).transpose(2, 3)
        ids = torch.tensor([2, 5, 7, 11])
        want, got = torch.zeros(3, 12, 64), torch.zeros(3, 12, 64)
        block_select.summarize_blocks(keys, ids, want)
        block_select_triton.summarize_blocks(keys, ids, got)
        assert torch.allclose(got, want)
        table = torch.tensor([[1, 2, 5, 7, 11, 0], [4, 11, 2, 0, 0, 0]])
        nblocks = torch.tensor([5, 3])
        q = torch.randn(2, 9, 32)
        info = torch.randn(2, 6)
        t = block_select_triton.block_scores(q, table, nblocks, want, 0.2, info)
        r = block_select.block_scores(q.view(2, 3, 3, 32), want, table, 0.2, info)
        r = r.masked_fill(torch.arange(6)[None] >= nblocks[:, None], float("-inf"))
        assert torch.allclose(t, r, atol=1e-4), (t, r)
        print("triton-ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "triton-ok" in result.stdout, result.stderr[-3000:]


def test_triton_pruned_decode_matches_torch_under_interpreter():
    script = textwrap.dedent("""
        import torch
        from kernels.pruned_decode_triton import pruned_decode, reference_decode
        torch.manual_seed(0)
        blocks, block_size, kv_heads, d = 24, 16, 3, 64
        key_cache = torch.randn(blocks, block_size, kv_heads, d)
        value_cache = torch.randn(blocks, block_size, kv_heads, d)
        q = torch.randn(3, 9, d)
        # compacted tables: kept blocks in logical order, current (partial) block last
        table = torch.tensor([[3, 7, 11, 2, 0], [5, 9, 0, 0, 0], [1, 4, 6, 8, 10]], dtype=torch.int32)
        seq_lens = torch.tensor([3 * 16 + 5, 16 + 1, 4 * 16 + 16], dtype=torch.int32)
        got = pruned_decode(q, key_cache, value_cache, table, seq_lens, 0.125)
        want = reference_decode(q, key_cache, value_cache, table, seq_lens, 0.125)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        # keeping every block is plain dense attention over the sequence
        full = torch.arange(5, dtype=torch.int32)[None]
        keys = key_cache[:5].reshape(-1, 3, d)[:70].repeat_interleave(3, 1)
        dense = torch.softmax(torch.einsum("hd,thd->ht", q[0], keys) * 0.125, -1)
        dense_out = torch.einsum("ht,thd->hd", dense, value_cache[:5].reshape(-1, 3, d)[:70].repeat_interleave(3, 1))
        lengths = torch.tensor([70], dtype=torch.int32)
        assert torch.allclose(pruned_decode(q[:1], key_cache, value_cache, full, lengths, 0.125)[0], dense_out, atol=1e-4)
        print("decode-ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "decode-ok" in result.stdout, result.stderr[-3000:]


def test_workload_quality_measures():
    from loadtest.workload import distinct_n, mixed_jobs, repetition_rate

    assert distinct_n([1, 2, 3, 4], 2) == 1.0
    assert distinct_n([1, 1, 1, 1], 2) == pytest.approx(1 / 3)
    assert repetition_rate([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 / 5)
    assert repetition_rate([1, 2, 3], 4) == 0.0
    jobs = mixed_jobs()
    assert {j.kind for j in jobs} == {"checkable", "passkey", "free_form"}
    assert all(j.answer in j.prompt for j in jobs if j.kind == "passkey")
    assert len({j.seed for j in jobs}) == len(jobs)
