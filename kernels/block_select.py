"""Block relevance and top-K block selection for entropic KV pruning (torch path; CPU serving).

Relevance of block b to the current query, for one decoding sequence (docs/pruning.md):

    score_b = scale * max_h U_{b,h} + w * log S_b
    U_{b,h} = sum_c max(q_{h,c} kmax_{b,g(h),c}, q_{h,c} kmin_{b,g(h),c})
            = q+_h . kmax_{b,g(h)} + q-_h . kmin_{b,g(h)}      (q+ = max(q,0), q- = min(q,0))
    S_b     = sum_{i in b} s_i,  s_i = -log p(x_i | x_<i)      (surprisal of token i)

U is Quest's upper bound of q.k over the block (per-channel key min/max), so every token's
attention weight in b is at most exp(scale * U_b - lse); the paper's I_b = sum_i a_i s_i is
therefore at most exp(scale * U_b - lse) * S_b, and score_b (w = 1) is the log of that bound
up to the row constant lse. The block table is shared by the KV heads, so a block is
scored by its most interested query head (max over h).

The q+/q- split turns the per-channel max into two batched matmuls instead of materialising
[P, blocks, heads, channels] products: this is the "fused" form the CPU path uses.
"""
from __future__ import annotations

import torch

KEEP = float("inf")


def block_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    scale: float,
    log_info: torch.Tensor | None = None,
    info_weight: float = 1.0,
) -> torch.Tensor:
    """Scores [P, NB] from queries q [P, KVH, G, D] and key summaries kmin/kmax [P, NB, KVH, D]."""
    q = q.float()
    pos, neg = q.clamp(min=0), q.clamp(max=0)
    upper = pos @ kmax.permute(0, 2, 3, 1) + neg @ kmin.permute(0, 2, 3, 1)  # [P, KVH, G, NB]
    score = upper.flatten(1, 2).amax(dim=1) * scale
    if log_info is not None and info_weight != 0.0:
        score = score + info_weight * log_info
    return score


def select_blocks(scores: torch.Tensor, num_blocks: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Logical block indices [P, max(keep)] in ascending order: the top ``keep[p]`` of row p.

    The sink (block 0) and the current block (num_blocks-1) are always chosen; entries past
    keep[p] are 0 (the kernel reads only the first ceil(seq_len / block_size) of them). The
    current block comes last, where the kernel expects the partially filled one.
    """
    rows, width = scores.shape
    kmax = int(keep.max())
    span = torch.arange(width, device=scores.device)
    s = scores.masked_fill(span[None, :] >= num_blocks[:, None], float("-inf"))
    s[:, 0] = KEEP
    s[torch.arange(rows, device=scores.device), num_blocks - 1] = KEEP
    top = s.topk(kmax, dim=1).indices
    beyond = torch.arange(kmax, device=scores.device)[None, :] >= keep[:, None]
    top = top.masked_fill(beyond, width).sort(dim=1).values
    return top.masked_fill(top >= width, 0)


def summarize_blocks(key_cache: torch.Tensor, block_ids: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
    """kmin/kmax [num_blocks, KVH, D] <- per-channel min/max over the tokens of whole blocks.

    ``key_cache`` is [num_blocks, KVH, block_size, D]. Only full blocks are summarized (the
    current, partially filled block is always kept and never scored), so a summary is
    computed once, when its block is first needed, instead of on every cache write.
    """
    if block_ids.numel() == 0:
        return
    keys = key_cache.index_select(0, block_ids).float()
    kmin.index_copy_(0, block_ids, keys.amin(dim=2))
    kmax.index_copy_(0, block_ids, keys.amax(dim=2))
