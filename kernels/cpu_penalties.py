"""vLLM's repetition, frequency and presence penalties on CPU logits, in place, in one C call
(kernels/csrc/penalties.c): the same logits, bit for bit, touching only each row's prompt and output tokens
where vLLM's CPU path passes over the whole [rows, vocab] batch several times. False, and nothing changed,
where the library cannot be built here or the input is not what it reads (float32 rows with unit column
stride, an int64 [rows, prompt length] prompt tensor, float32 [rows] penalties): the caller then applies
vLLM's own path.
"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import torch

from kernels import cbuild


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.entropic_apply_penalties.argtypes = [p, i64, i64, i64, p, i64, p, p, p, p, p]
    lib.entropic_apply_penalties.restype = ctypes.c_int


def load() -> ctypes.CDLL | None:
    return cbuild.load("penalties", _declare)


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor, output_token_ids: list[list[int]]) -> bool:
    """Penalize ``logits`` [rows, vocab] in place as vLLM's ``apply_all_penalties`` does, given the same
    arguments: the prompts [rows, length] padded with ids outside the vocabulary, each row's output ids so
    far (ids outside the vocabulary skipped), and the three penalties [rows]."""
    lib = load()
    rows = logits.shape[0] if logits.dim() == 2 else -1
    penalties = [presence, frequency, repetition]
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or rows < 0
            or logits.stride(1) != 1 or prompt_token_ids.dtype != torch.int64 or prompt_token_ids.dim() != 2
            or prompt_token_ids.shape[0] != rows or prompt_token_ids.device.type != "cpu"
            or len(output_token_ids) != rows
            or any(t.dtype != torch.float32 or t.shape != (rows,) or t.device.type != "cpu" for t in penalties)):
        return False
    prompt = prompt_token_ids.contiguous()
    presence, frequency, repetition = (t.contiguous() for t in penalties)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum([len(o) for o in output_token_ids], out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(output_token_ids), dtype=np.int64, count=int(offsets[-1]))
    status = lib.entropic_apply_penalties(
        logits.data_ptr(), rows, logits.shape[1], logits.stride(0), prompt.data_ptr(), prompt.shape[1],
        flat.ctypes.data, offsets.ctypes.data, presence.data_ptr(), frequency.data_ptr(), repetition.data_ptr())
    return status == 0
