"""kernels/csrc/linear_bf16w.c against float64 torch, and workers/decode_weights.py on vLLM's own linear layer: the
kernel for steps of few rows, vLLM's oneDNN GEMM for the rest, vLLM's dispatch wherever the engine did not ask."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from kernels import cbuild, cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="the kernel needs AVX2 and FMA and a C compiler")

# every code path of the C source this CPU can run, not only the one it serves with (the host's build)
BUILDS = ["host", *cbuild.runnable_isas("linear_bf16w")]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    directory = tmp_path_factory.mktemp("linear_bf16w")
    libs = {name: cpu_linear.load(str(cbuild.build_for("linear_bf16w", isa, directory)))
            for name, isa in cbuild.runnable_isas("linear_bf16w").items()}
    return {"host": None, **libs}


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows,n,k,with_bias", [
    (1, 960, 576, False), (8, 3072, 576, True), (5, 576, 1536, False),  # the default model's shapes
    (16, 960, 576, False), (25, 576, 576, True),  # rows in several passes (of at most 6 with AVX2, 12 with AVX-512)
    (3, 7, 13, True), (7, 33, 8, False), (13, 6, 1, True),  # columns past a panel (16 or 32), rows past a pass
    (12, 100, 40, False),
])
@pytest.mark.parametrize("build", BUILDS)
def test_the_kernel_computes_the_float32_product_of_the_bfloat16_weights(builds, build, rows, n, k, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = torch.full((rows, n), float("nan"))
    lib = builds[build]
    assert cpu_linear.linear_bf16w(x, cpu_linear.pack(weight, lib), n, bias, out, lib)
    # float32 sums of k products: a rounding error of about sqrt(k) ulps of the terms, far below 1e-4 here
    torch.testing.assert_close(out.double(), _reference(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_rows_apart_in_memory_are_read_and_written_at_their_stride():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 40, generator=gen).to(torch.bfloat16)
    wide = torch.randn(6, 64, generator=gen)
    x = wide[::2, 3:43]  # 3 rows, 128 floats apart
    out = torch.zeros(3, 20)
    assert cpu_linear.linear_bf16w(x, cpu_linear.pack(weight), 12, None, out[:, 4:16])
    torch.testing.assert_close(out[:, 4:16].double(), _reference(x, weight, None), rtol=1e-5, atol=1e-4)
    assert not out[:, :4].any() and not out[:, 16:].any()  # nothing outside the view


def test_the_kernel_declines_what_it_does_not_compute():
    x, out, packed = torch.randn(2, 8), torch.empty(2, 4), cpu_linear.pack(torch.randn(4, 8))
    width = packed.shape[2]
    assert packed.shape == (1, 8, width) and width in (16, 32) and cpu_linear.linear_bf16w(x, packed, 4, None, out)
    assert not cpu_linear.linear_bf16w(x.double(), packed, 4, None, out)
    assert not cpu_linear.linear_bf16w(x, packed.float(), 4, None, out)  # panels of float32
    assert not cpu_linear.linear_bf16w(torch.randn(2, 9), packed, 4, None, out)  # K differs
    wider = torch.empty(2, width + 1)  # needs two panels
    assert not cpu_linear.linear_bf16w(x, packed, width + 1, None, wider)
    assert not cpu_linear.linear_bf16w(x, packed, 4, torch.randn(4).double(), out)


def test_only_a_tensor_of_bfloat16_values_counts_as_one():
    widened = torch.randn(64, 64).to(torch.bfloat16).float()
    assert cpu_linear.holds_bf16_values(widened)
    widened[3, 5] += 1e-4  # one value between two bfloat16 values
    assert not cpu_linear.holds_bf16_values(widened)
    assert not cpu_linear.holds_bf16_values(torch.randn(4, 4).bfloat16())  # only float32 is widened


class _Linear(torch.nn.Module):
    """A linear layer as vLLM's model code holds one (weight [N, K], its quant method): ``ReplicatedLinear`` itself
    asks for a tensor-parallel group, which only an engine sets up."""

    def __init__(self, weight: torch.Tensor):
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


def _layer(k: int, n: int, bf16_values: bool, rows: int | str | None, dtype=torch.float32):
    """A linear layer with loaded weights after vLLM's CPU weight processing, in an engine configuration that asks
    for bfloat16 decode weights up to ``rows`` rows (None: that does not ask)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from workers import decode_weights
    from workers.config import BF16_DECODE_WEIGHTS_KEY

    decode_weights.install()  # what the plugin does in every vLLM process
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    weight = weight.to(torch.bfloat16).float() if bf16_values else weight
    layer = _Linear(weight.to(dtype))
    # a VllmConfig on CPU sets process-wide variables (LD_PRELOAD of torch's libgomp among them) that later tests'
    # child processes would inherit: kept to this call
    with mock.patch.dict(os.environ):
        config = VllmConfig(additional_config={BF16_DECODE_WEIGHTS_KEY: rows} if rows else {})
        with set_current_vllm_config(config):
            layer.quant_method.process_weights_after_loading(layer)
    return layer, weight


def test_a_layer_of_bfloat16_values_runs_few_rows_on_the_kernel_and_many_on_onednn(vllm_cpu_ops, monkeypatch):
    layer, weight = _layer(576, 960, bf16_values=True, rows=6)
    # [960 / W, 576, W] for the panel width W: panel p, input k, position 2 j + h holding column W p + h W / 2 + j
    panels = layer.weight_bf16_panels
    width = panels.shape[2]
    assert panels.dtype == torch.bfloat16 and panels.shape == (960 // width, 576, width)
    columns = panels.reshape(960 // width, 576, width // 2, 2).permute(0, 3, 2, 1).reshape(960, 576)
    assert torch.equal(columns.float(), weight)
    assert layer.weight.numel() == 0  # as vLLM's own oneDNN path leaves it: its packed copy holds the floats
    calls = []
    kernel = cpu_linear.linear_bf16w
    monkeypatch.setattr(cpu_linear, "linear_bf16w", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for rows in (1, 6, 7, 300):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        out = layer(x)
        torch.testing.assert_close(out.double(), _reference(x, weight, None), rtol=1e-4, atol=1e-3)
    assert calls == [1, 6], "steps of more rows than max_rows go to vLLM's GEMM"
    # compiled as vLLM compiles a model: the op is one node of the graph, its branch taken at run time
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (4, 64):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(compiled(x).double(), _reference(x, weight, None), rtol=1e-4, atol=1e-3)
    assert calls[2:] == [4]


def test_auto_runs_on_the_kernel_the_rows_it_outruns_vllms_gemm_at(vllm_cpu_ops, monkeypatch):
    layer, weight = _layer(64, 48, bf16_values=True, rows="auto")
    limit = cpu_linear.rows()
    assert limit >= 8  # a decode batch of 8 (the long benchmark's) on either build
    calls = []
    kernel = cpu_linear.linear_bf16w
    monkeypatch.setattr(cpu_linear, "linear_bf16w", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for rows in (limit, limit + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x).double(), _reference(x, weight, None), rtol=1e-4, atol=1e-3)
    assert calls == [limit]


def test_vllms_dispatch_keeps_every_layer_the_engine_did_not_ask_for_or_cannot_store_in_bfloat16(vllm_cpu_ops):
    for kwargs in ({"bf16_values": True, "rows": None}, {"bf16_values": False, "rows": 16},
                   {"bf16_values": True, "rows": 16, "dtype": torch.bfloat16}):
        layer, weight = _layer(64, 32, **kwargs)
        assert not hasattr(layer, "weight_bf16_panels"), kwargs
        x = torch.randn(2, 64, dtype=kwargs.get("dtype", torch.float32))
        torch.testing.assert_close(layer(x).double(), _reference(x, weight, None), rtol=2e-2, atol=2e-2)


def test_the_engine_asks_for_bfloat16_decode_weights_where_it_runs_float32_on_cpu():
    from workers.config import BF16_DECODE_WEIGHTS_KEY, EngineConfig

    def extra(on_gpu=False, **fields):
        return EngineConfig(**fields).engine_kwargs("m", "m", on_gpu=on_gpu).get("additional_config")

    assert extra(dtype="float32") == {BF16_DECODE_WEIGHTS_KEY: EngineConfig().bf16_decode_weights}
    assert extra(dtype="float32", bf16_decode_weights=0) is None
    assert extra(dtype="bfloat16") is None and extra(dtype="float32", on_gpu=True) is None
    # a user's own additional_config (engine.extra) is kept beside ours
    assert extra(dtype="float32", extra={"additional_config": {"theirs": 1}}) == {
        BF16_DECODE_WEIGHTS_KEY: EngineConfig().bf16_decode_weights, "theirs": 1}
