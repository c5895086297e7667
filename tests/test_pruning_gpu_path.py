"""The GPU path of entropic KV pruning (workers.pruned_attention_gpu), run where no GPU is: under Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors.

What runs for real: our per-layer selection on the device kernels (summaries, scores, top-K, compacted
table) and vLLM 0.32.0's own ``unified_attention`` Triton kernel — the one its TRITON_ATTN backend
launches — fed the compacted table and sequence lengths. What the interpreter stands in for: the CUDA
launch of those kernels (there is no GPU on the development machine), and the script hands vLLM's
``vllm.triton_utils`` the real Triton module, which vLLM replaces by a placeholder on machines without a
GPU backend. The engine-level wiring (builder,
CUDA graphs off for attention, backend selection) is pinned in tests/test_vllm_pins.py.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import types
    import torch
    from kernels.block_select import block_scores, select_blocks, selection_bias, summarize_blocks
    from kernels.pruned_decode_triton import pruned_decode, reference_decode
    # vLLM turns Triton off where no GPU backend is (HAS_TRITON false, placeholder modules); on a GPU it is on.
    # Give vllm.triton_utils the real Triton before vLLM's kernel module binds it, so the interpreter runs it.
    import triton, triton.language, triton.language.extra.libdevice, vllm.triton_utils as vtu
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate
    vtu.triton, vtu.tl, vtu.tldevice, vtu.gluon, vtu.gl, vtu.aggregate = (
        triton, triton.language, triton.language.extra.libdevice, gluon, gl, _aggregate)
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from workers.pruned_attention_gpu import compacted_table
    from workers.pruning_plan import PrunePlan

    torch.manual_seed(0)
    blocks, kv_heads, bs, d, heads = 40, 2, 16, 32, 6
    kv_cache = torch.randn(blocks, kv_heads, bs, 2 * d)  # the Triton backend's (B, H, N, 2*hs)
    # two decode rows: 9 and 6 logical blocks, the current one partly filled
    seq_lens = torch.tensor([8 * bs + 5, 5 * bs + 11])
    nblocks = (seq_lens + bs - 1) // bs
    block_table = torch.zeros(2, 12, dtype=torch.int32)
    block_table[0, :9] = torch.tensor([3, 17, 5, 22, 9, 31, 12, 1, 27])
    block_table[1, :6] = torch.tensor([8, 14, 36, 2, 19, 25])
    keep = torch.tensor([4, 3])
    width = int(nblocks.max())
    physical = block_table[:, :width].long()
    interior = torch.cat([physical[0, 1:8], physical[1, 1:5]]).unique()
    bias = selection_bias(nblocks, width, torch.randn(2, width))
    kmax = int(keep.max())
    plan = PrunePlan(rows=torch.tensor([0, 1]), tokens=torch.tensor([0, 1]), physical=physical, num_blocks=nblocks,
                     bias=bias, keep=keep, kmax=kmax, beyond=torch.arange(kmax)[None] >= keep[:, None],
                     summarize=interior, table=block_table.clone())
    query = torch.randn(2, heads, d)
    impl = types.SimpleNamespace(head_size=d, scale=d ** -0.5, _summaries=None)
    table = compacted_table(impl, query, kv_cache, plan)

    # the same choice through the torch path
    ref_summaries = torch.zeros(kv_heads, blocks, 2 * d)
    summarize_blocks(kv_cache[..., :d], interior, ref_summaries)
    want = physical.gather(1, select_blocks(block_scores(query.view(2, kv_heads, -1, d), ref_summaries, physical,
                                                         d ** -0.5, bias), keep))
    for p in range(2):
        assert table[p, :keep[p]].tolist() == want[p, :keep[p]].tolist(), (table, want)
    assert table[0, 0] == 3 and table[0, 3] == 27 and table[1, 2] == 25  # sink first, current block last

    # vLLM's Triton attention over the compacted table = attention over exactly the kept blocks
    compact_lens = ((keep - 1) * bs + (seq_lens - (nblocks - 1) * bs)).to(torch.int32)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)  # as TritonAttentionImpl.forward
    out = torch.empty_like(query)
    unified_attention(q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                      max_seqlen_q=1, seqused_k=compact_lens, max_seqlen_k=int(compact_lens.max()),
                      softmax_scale=d ** -0.5, causal=True, window_size=(-1, -1), block_table=table, softcap=0,
                      q_descale=None, k_descale=None, v_descale=None)
    expected = reference_decode(query, key_cache, value_cache, table, compact_lens, d ** -0.5)
    assert torch.allclose(out, expected, atol=1e-4), (out - expected).abs().max()
    # and our own pruned decode kernel agrees with vLLM's on the same table
    mine = pruned_decode(query, key_cache, value_cache, table, compact_lens, d ** -0.5)
    assert torch.allclose(mine, expected, atol=1e-4)
    print("gpu-path-ok")
""")


def test_gpu_selection_and_vllm_triton_attention_on_the_compacted_table_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "gpu-path-ok" in result.stdout, (result.stdout[-2000:], result.stderr[-4000:])


SELECT_SCRIPT = textwrap.dedent("""
    import torch
    from kernels.block_select import select_blocks, selection_bias
    from kernels.block_select_triton import select_into_table
    torch.manual_seed(0)
    for rows_n, width in [(1, 5), (3, 40), (4, 300), (2, 2)]:
        nblocks = torch.randint(2, width + 1, (rows_n,))
        nblocks[0] = width
        scores = torch.randn(rows_n, width) + selection_bias(nblocks, width)
        tied = scores.clone()
        tied[:, 1:width - 1] = tied[:, 1:width - 1].round()  # many equal scores
        keep = torch.clamp(nblocks // 3, min=2)
        kmax = int(keep.max())
        beyond = torch.arange(kmax)[None] >= keep[:, None]
        physical = torch.stack([torch.randperm(1000)[:width] for _ in range(rows_n)])
        for case in (scores, tied):
            table = torch.full((rows_n + 2, width + 3), -1, dtype=torch.int32)
            rows = torch.randperm(rows_n + 2)[:rows_n]
            select_into_table(case, keep, physical, table, rows, kmax, beyond)
            for p in range(rows_n):
                k = int(keep[p])
                got = table[rows[p], :k].tolist()
                # the k highest, ties to the lower position, in ascending logical order
                best = sorted(range(width), key=lambda i: (-float(case[p, i]), i))[:k]
                assert got == [int(physical[p, i]) for i in sorted(best)], (got, best)
                assert got[0] == int(physical[p, 0]) and got[-1] == int(physical[p, nblocks[p] - 1])
                assert (table[rows[p], k:] == -1).all()  # past keep[p]: untouched
                if case is scores:  # no ties: the same set as the torch path
                    torch_path = select_blocks(case[p:p + 1], keep[p:p + 1], k)[0]
                    assert got == physical[p].gather(0, torch_path).tolist()
    print("select-ok")
""")


def test_fused_top_k_writes_the_torch_paths_choice_into_the_table_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", SELECT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "select-ok" in result.stdout, (result.stdout[-2000:], result.stderr[-4000:])
