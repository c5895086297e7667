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
