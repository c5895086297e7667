"""Decode steps of a float32 engine read the weights of a bfloat16 checkpoint as bfloat16 (kernels/cpu_linear.py).

vLLM on CPU gives each unquantized linear layer a GEMM when its weights are loaded
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which ``UnquantizedLinearMethod`` and the
tied LM head's ``UnquantizedEmbeddingMethod`` import when they call it): for float32 weights, oneDNN over a packed
float32 copy. Where the engine asks for it (``EngineConfig.bf16_decode_weights``, passed in vLLM's
``additional_config`` under ``BF16_DECODE_WEIGHTS_KEY``, which also keys vLLM's compile cache), the plugin's
wrapper of that function gives a float32 layer whose every weight is a bfloat16 value a second copy of them in
bfloat16 (in the kernel's panels), and a GEMM (the custom op ``entropic::linear_bf16_weights``) that runs steps
of at most ``max_rows`` rows (decode steps, and the LM head's rows of any step) on the kernel and larger ones on
vLLM's oneDNN GEMM, as before. Any other layer, dtype or platform gets vLLM's own dispatch. The results are the
float32 GEMM's up to the order of its sums; the cost is the bfloat16 copy's memory, half the float32 weights'.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from kernels import cpu_linear

logger = logging.getLogger(__name__)


# A CPU kernel of a torch.library.Library, as vLLM registers its own ops, rather than torch.library.custom_op,
# whose Python layers around each call cost more than a batch-1 step's kernel for a small layer
_LIBRARY = torch.library.Library("entropic", "FRAGMENT")
_LIBRARY.define("linear_bf16_weights(Tensor x, Tensor packed, Tensor? bias, Tensor handler, int n, int max_rows)"
                " -> Tensor")


def linear_bf16_weights(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, handler: torch.Tensor,
                        n: int, max_rows: int) -> torch.Tensor:
    """x [..., K] float32 @ weight [n, K].T + bias: on the kernel, from the weight's bfloat16 panels ``packed``
    (kernels.cpu_linear.pack), for at most ``max_rows`` rows; else on vLLM's oneDNN GEMM through ``handler`` (its
    packed float32 copy). ``torch.ops.entropic.linear_bf16_weights``."""
    rows = x.reshape(-1, packed.shape[1])
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if rows.shape[0] <= max_rows and cpu_linear.linear_bf16w(rows, packed, n, bias, out.view(-1, n)):
        return out
    torch.ops._C.onednn_mm(out, rows, bias, handler)
    return out


_LIBRARY.impl("linear_bf16_weights", linear_bf16_weights, "CPU")


@torch.library.register_fake("entropic::linear_bf16_weights")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, handler: torch.Tensor, n: int,
      max_rows: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _max_rows() -> int | None:
    """The engine's setting (rows a step may have to run on the kernel; ``auto``: the host build's own), None
    where it did not ask."""
    from vllm.config import get_current_vllm_config

    from workers.config import BF16_DECODE_WEIGHTS_KEY  # here: the plugin imports this module in every vLLM process

    extra = get_current_vllm_config().additional_config
    value = extra.get(BF16_DECODE_WEIGHTS_KEY) if isinstance(extra, dict) else None
    if value == "auto":
        value = cpu_linear.rows()
    return int(value) if value else None


def dispatch(layer: torch.nn.Module, remove_weight: bool, vllm_dispatch: Any) -> None:
    """In place of ``vllm_dispatch`` (vLLM's ``dispatch_cpu_unquantized_gemm``), for one layer after loading."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.platforms import current_platform

    max_rows = _max_rows()
    weight = layer.weight
    # an input embedding is looked up, never multiplied (a tied LM head is a module of its own)
    lookup_only = isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
    if (max_rows is None or lookup_only or weight.is_meta or weight.ndim != 2 or weight.dtype != torch.float32
            or not ops._supports_onednn or current_platform.is_zen_cpu()
            or not cpu_linear.available() or not cpu_linear.holds_bf16_values(weight.data)):
        vllm_dispatch(layer, remove_weight)
        return
    packed = cpu_linear.pack(weight.data)
    if packed is None:
        vllm_dispatch(layer, remove_weight)
        return
    n = weight.shape[0]
    # as vLLM's oneDNN branch builds it, for the steps with more rows than max_rows
    handler = ops.create_onednn_mm(weight.data.t(), 32)
    # a buffer of the layer, not a closure's tensor, so that the compiled graph takes it as an input
    layer.register_buffer("weight_bf16_panels", packed, persistent=False)
    layer._entropic_onednn = handler  # the handler frees oneDNN's copy when collected
    layer.cpu_linear = lambda x, weight, bias: torch.ops.entropic.linear_bf16_weights(
        x, layer.weight_bf16_panels, bias, handler.handler_tensor, n, max_rows)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    logger.debug("layer %s: decode steps on bfloat16 weights", getattr(layer, "prefix", type(layer).__name__))


def install() -> None:
    """Wrap vLLM's dispatch (the plugin calls this in every vLLM process; it changes nothing for an engine
    whose ``additional_config`` does not ask)."""
    from vllm.model_executor.layers import utils

    vllm_dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if vllm_dispatch is None or getattr(vllm_dispatch, "_entropic", False):
        return  # a vLLM without CPU GEMM dispatch (tests/test_vllm_pins.py pins the one we wrap), or installed

    def wrapped(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight, vllm_dispatch)

    wrapped._entropic = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = wrapped
