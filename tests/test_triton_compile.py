"""Every Triton kernel of ours compiles for a real GPU target (sm_90), on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1), which the other kernel tests run under, executes kernels as
Python and accepts code the compiler refuses: a plain module-level float used inside a kernel ran
there and failed to compile on the first real GPU (docs/results/gpu-kernels.md). Triton's wheel
carries ptxas, so the whole pipeline down to a cubin runs here; only the launch needs a GPU.
"""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import block_select_triton, entropy_triton, pruned_decode_triton  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)


def _sig(names: str, types: str) -> dict:
    return dict(zip(names.split(), types.split()))


KERNELS = {
    "entropy partial (bf16 logits)": (
        entropy_triton._partial_stats_kernel,
        _sig("z_ptr stride n_cols chunk part_ptr BLOCK", "*bf16 i32 i32 i32 *fp32 constexpr"), {"BLOCK": 2048}),
    "entropy combine": (
        entropy_triton._combine_stats_kernel,
        _sig("part_ptr splits lse_ptr h_ptr nfin_ptr BLOCK_S", "*fp32 i32 *fp32 *fp32 *i32 constexpr"),
        {"BLOCK_S": 64}),
    "top-k entropies": (
        entropy_triton._topk_entropy_kernel,
        _sig("top_ptr k lse_ptr nfin_ptr trunc_ptr corr_ptr BLOCK_K", "*fp32 i32 *fp32 *i32 *fp32 *fp32 constexpr"),
        {"BLOCK_K": 64}),
    "key summaries (bf16 cache)": (
        block_select_triton._summarize_kernel,
        _sig("keys_ptr ids_ptr out_ptr n_blocks block_size d s_blk s_head s_tok s_ch BLOCK_T BLOCK_D",
             "*bf16 *i64 *bf16 i32 i32 i32 i64 i64 i64 i64 constexpr constexpr"), {"BLOCK_T": 16, "BLOCK_D": 128}),
}
for dtype, ieee in (("bf16", False), ("fp32", True)):
    KERNELS[f"block scores ({dtype} summaries)"] = (
        block_select_triton._score_kernel,
        _sig("q_ptr table_ptr nblocks_ptr sum_ptr bias_ptr out_ptr kv_heads group d width n_blocks scale s_q_row "
             "s_q_head HAS_BIAS IEEE BLOCK_G BLOCK_N BLOCK_D",
             f"*{dtype} *i64 *i64 *{dtype} *fp32 *fp32 i32 i32 i32 i32 i32 fp32 i32 i32 "
             "constexpr constexpr constexpr constexpr constexpr"),
        {"HAS_BIAS": True, "IEEE": ieee, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128})
KERNELS["top-K into the block table"] = (
    block_select_triton._select_kernel,
    _sig("scores_ptr keep_ptr physical_ptr rows_ptr table_ptr width s_table BLOCK_W",
         "*fp32 *i64 *i64 *i64 *i32 i32 i32 constexpr"), {"BLOCK_W": 2048})
KERNELS["pruned decode (bf16 cache)"] = (
    pruned_decode_triton._pruned_decode_kernel,
    _sig("q_ptr k_ptr v_ptr table_ptr lens_ptr out_ptr scale group d s_q_seq s_q_head s_c_blk s_c_tok s_c_head "
         "s_t_seq s_o_seq s_o_head BLOCK_SIZE BLOCK_D",
         "*bf16 *bf16 *bf16 *i32 *i32 *bf16 fp32 i32 i32 i32 i32 i64 i64 i64 i32 i32 i32 constexpr constexpr"),
    {"BLOCK_SIZE": 16, "BLOCK_D": 128})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_sm90(name):
    fn, signature, constexprs = KERNELS[name]
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=H100)
    assert compiled.asm.get("cubin"), f"{name}: no cubin"
