"""Logits processors that measure output fidelity on the real engine (adapter; vllm 0.32.0).

Instruments of the pruning tests and the benchmarks, never on the serving path. Per request,
through flat ``SamplingParams.extra_args`` keys (what an OpenAI request's ``vllm_xargs`` can carry,
so they also reach an engine through ``workers.core.ReplicaCore``):

* ``fidelity_scale: s`` (``LogitScale``): multiplies the logits by s before anything else sees
  them. s > 1 makes the model look overconfident (entropy drops, argmax unchanged): the
  calibration stress of paper §6.2.
* ``fidelity_key: k, fidelity_force: [ids...]`` (``TeacherForcing``): records the row's
  log-softmax (its argmax and the full distribution for KL) under ``records[k]`` and then forces
  the next token to force[position], so a pruned and a dense run see the same prefixes (teacher
  forcing) while every position is a real decode step.

List them before/after ``EntropicLogitsProcessor`` as needed: vLLM applies processors in
the order given.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from workers.sampling import apply_moves

KEY = "fidelity_key"
SCALE = "fidelity_scale"
FORCE = "fidelity_force"


class _RowProcessor(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[dict[str, Any], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            cfg = (params.extra_args or {}) if params is not None else {}
            if self.wants(cfg):
                self.rows[index] = (cfg, output_ids)
            else:
                self.rows.pop(index, None)
        apply_moves(self.rows, batch_update)

    def wants(self, cfg: dict[str, Any]) -> bool:
        raise NotImplementedError


class LogitScale(_RowProcessor):
    def wants(self, cfg: dict[str, Any]) -> bool:
        return SCALE in cfg

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (cfg, _) in self.rows.items():
            if index < logits.shape[0]:
                logits[index] *= float(cfg[SCALE])
        return logits


class TeacherForcing(_RowProcessor):
    """Records log p(. | forced prefix) per position into ``records[key]``; forces the next token."""

    records: dict[str, dict[int, torch.Tensor]] = {}

    def wants(self, cfg: dict[str, Any]) -> bool:
        return FORCE in cfg

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (cfg, output_ids) in self.rows.items():
            if index >= logits.shape[0]:
                continue
            pos = len(output_ids)
            TeacherForcing.records.setdefault(cfg[KEY], {})[pos] = torch.log_softmax(logits[index].float(), -1).clone()
            forced = cfg[FORCE]
            if pos < len(forced):
                logits[index].fill_(float("-inf"))
                logits[index, forced[pos]] = 0.0
        return logits
