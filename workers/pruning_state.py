"""Per-process state shared by the sampling processor, the pruned attention backend and the engine runner.

vLLM hands the attention metadata builder no request ids, but its rows are the model
runner's input-batch rows, which are also the logits processor's batch indices (vllm 0.32.0:
``refresh_metadata`` updates the processors before the step's attention metadata is built).
The logits processor therefore publishes its row -> request state map here, and the builder
reads each decoding row's request key, pruning parameters and latest entropy from it.

One engine per process (the replica's in-process engine, or a vLLM worker process) and one
engine thread: the builder, the attention layers and the runner's delivery all run on that
thread between steps, so nothing here needs a lock; metric readers only read counters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.laws.pruning import PruningLaw, blocks_to_keep, next_keep_fraction

if TYPE_CHECKING:
    import torch


@dataclass
class RequestPruning:
    law: PruningLaw
    info_weight: float
    fraction: float | None = None
    block_surprisal: list[float] = field(default_factory=list)  # S_b per logical block, known tokens only
    known_tokens: list[int] = field(default_factory=list)
    surprisal_total: float = 0.0
    surprisal_count: int = 0
    kept_log: list[tuple[int, int]] = field(default_factory=list)  # (kept, total) per decode step, drained
    # block_surprisal and known_tokens as float64 rows [2, capacity], current for the blocks before _synced: the
    # planner asks for every row's log S_b in every step, and a step adds surprisal to the last block only
    _sums: torch.Tensor | None = field(default=None, repr=False)
    _synced: int = 0

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RequestPruning:
        law_args = {k: v for k, v in args.items() if k != "info_weight"}
        return cls(law=PruningLaw(**law_args), info_weight=float(args.get("info_weight", 1.0)))

    def decide(self, entropy: float, num_blocks: int, context_tokens: int) -> int:
        self.fraction = next_keep_fraction(self.fraction, entropy, self.law)
        return blocks_to_keep(num_blocks, context_tokens, self.fraction, self.law)

    def add_surprisal(self, start: int, values: list[float | None], block_size: int) -> None:
        """Surprisal of the tokens at positions start, start+1, ... of the sequence."""
        for offset, s in enumerate(values):
            if s is None or not math.isfinite(s):
                continue
            b = (start + offset) // block_size
            while len(self.block_surprisal) <= b:
                self.block_surprisal.append(0.0)
                self.known_tokens.append(0)
            self.block_surprisal[b] += s
            self.known_tokens[b] += 1
            self._synced = min(self._synced, b)
            self.surprisal_total += s
            self.surprisal_count += 1

    def log_info(self, num_blocks: int, block_size: int) -> torch.Tensor | None:
        """log S_b [num_blocks] float64 for the first num_blocks blocks; unknown tokens count at the request's mean
        surprisal."""
        # torch imported here, not with the module: the engine process imports this module before it pins its
        # cores, and torch's OpenMP runtime counts the CPUs it may use when it loads (workers/process.py, _pin)
        import torch

        if not self.surprisal_count or self.info_weight == 0.0:
            return None
        have = len(self.block_surprisal)
        sums = self._sums
        if sums is None or sums.shape[1] < max(have, num_blocks):
            capacity = 0 if sums is None else sums.shape[1]
            grown = torch.zeros(2, max(have, num_blocks, 2 * capacity), dtype=torch.float64)
            if sums is not None:
                grown[:, : self._synced] = sums[:, : self._synced]
            sums = self._sums = grown
        if self._synced < have:
            lo = self._synced
            sums[:, lo:have] = torch.tensor([self.block_surprisal[lo:], self.known_tokens[lo:]], dtype=torch.float64)
            self._synced = have
        mean = self.surprisal_total / self.surprisal_count
        # total + (block_size - known) * mean
        total = torch.add(sums[0, :num_blocks], sums[1, :num_blocks], alpha=-mean)
        return total.add_(block_size * mean).clamp_(min=1e-6).log_()


class PruningStats:
    """Cumulative counters (read by the replica's metrics, deltas per scrape)."""

    def __init__(self) -> None:
        self.blocks_total = 0
        self.blocks_kept = 0
        self.attention_flops_saved = 0.0
        self.kv_bytes_saved = 0.0
        self.selection_seconds = 0.0
        self.decode_kernel_layers = 0  # layer calls our decode kernel answered instead of vLLM's


class PruningState:
    def __init__(self) -> None:
        self.rows: dict[int, Any] = {}
        self.requests: dict[str, RequestPruning] = {}
        self.stats = PruningStats()
        self.dense_layers = 0
        # Debug/test knob: send rows through selection even when every block is kept, to show the
        # pruned path itself (compacted table, scheduler metadata) changes nothing.
        self.always_select = False
        # The C kernels (selection: kernels.cpu_select, key summaries: kernels.cpu_summary); False runs the
        # torch path (benchmarks compare both).
        self.fused_selection = True
        # Pure-decode steps attend with kernels.cpu_decode_attention where it runs (from engine.decode_kernel);
        # False: vLLM's kernel.
        self.decode_kernel = True

    def attach_rows(self, rows: dict[int, Any]) -> None:
        """The logits processor's live batch-index -> request-state map."""
        self.rows = rows

    def request(self, key: str, args: dict[str, Any]) -> RequestPruning:
        state = self.requests.get(key)
        if state is None:
            state = self.requests[key] = RequestPruning.from_args(args)
        return state

    def drain_kept(self, key: str) -> list[tuple[int, int]]:
        state = self.requests.get(key)
        if state is None or not state.kept_log:
            return []
        out, state.kept_log = state.kept_log, []
        return out

    def forget(self, key: str) -> None:
        self.requests.pop(key, None)


STATE = PruningState()
