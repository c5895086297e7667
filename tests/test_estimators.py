"""Entropy estimators on real logits of the default model, and the Triton kernels under the interpreter."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import cpu_entropy
from kernels.entropy import Estimator, estimate, exact_entropy, exact_entropy_and_log_norm, topk_entropies

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=[0.3, 1.0, 3.0], ids=lambda t: f"T={t}")
def tempered(real_logits, request):
    return real_logits / request.param


def test_exact_matches_float64_reference(tempered):
    p = torch.softmax(tempered.double(), -1)
    reference = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    assert torch.allclose(exact_entropy(tempered).double(), reference, atol=2e-4, rtol=1e-5)


def test_the_log_normalizer_of_the_entropy_pass_is_logsumexp_masked_tokens_too(tempered):
    z = tempered.clone()
    z[:, 1000:40000] = float("-inf")
    entropy, log_norm = exact_entropy_and_log_norm(z)
    assert torch.allclose(log_norm.double(), torch.logsumexp(z.double(), -1), atol=1e-4, rtol=1e-6)
    assert torch.equal(entropy, exact_entropy(z))


@pytest.mark.parametrize("scale", [1 / 0.3, 1.0, 1 / 3.0])
def test_the_c_kernel_gives_the_references_entropy_and_normalizer_masked_tokens_and_strided_rows_too(real_logits,
                                                                                                       scale):
    assert cpu_entropy.load() is not None, "the C kernel must build where the tests run (a C compiler is needed)"
    wide = torch.full((real_logits.shape[0], real_logits.shape[1] + 37), 99.0)  # rows of a wider buffer
    wide[:, :-37] = real_logits
    wide[1, 1000:40000] = float("-inf")
    z = wide[:, :-37]
    assert not z.is_contiguous()
    entropy, log_norm = cpu_entropy.exact_entropy_and_log_norm(z, torch.full((z.shape[0],), scale))
    p = torch.softmax(z.double() * scale, -1)
    reference = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    assert torch.allclose(entropy.double(), reference, atol=2e-4, rtol=1e-5)
    assert torch.allclose(log_norm.double(), torch.logsumexp(z.double() * scale, -1), atol=1e-4, rtol=1e-6)


def test_the_c_kernel_declines_what_it_does_not_read(real_logits):
    ones = torch.ones(real_logits.shape[0])
    assert cpu_entropy.exact_entropy_and_log_norm(real_logits.double(), ones) is None
    assert cpu_entropy.exact_entropy_and_log_norm(real_logits.t(), torch.ones(real_logits.shape[1])) is None
    assert cpu_entropy.exact_entropy_and_log_norm(real_logits, -ones) is None  # the kernel refuses, no answer
    entropy, _ = cpu_entropy.exact_entropy_and_log_norm(torch.full((1, 50), float("-inf")), torch.ones(1))
    assert torch.isnan(entropy).all()  # every token masked: no distribution, as in the torch path


@pytest.mark.parametrize("k", [1, 8, 64, 512])
def test_truncated_below_exact_below_tail_corrected(tempered, k):
    exact = exact_entropy(tempered)
    truncated, corrected = topk_entropies(tempered, k)
    assert bool((truncated <= exact + 1e-4).all()), (truncated - exact).max()
    assert bool((exact <= corrected + 1e-4).all()), (exact - corrected).max()


def test_bounds_hold_with_masked_tokens(real_logits):
    z = real_logits.clone()
    z[:, 1000:40000] = float("-inf")
    exact = exact_entropy(z)
    truncated, corrected = topk_entropies(z, 16)
    assert torch.isfinite(exact).all() and torch.isfinite(corrected).all()
    assert bool((truncated <= exact + 1e-4).all()) and bool((exact <= corrected + 1e-4).all())


def test_estimate_selects_the_estimator(real_logits):
    truncated, corrected = topk_entropies(real_logits, 32)
    assert torch.equal(estimate(real_logits, "exact"), exact_entropy(real_logits))
    assert torch.equal(estimate(real_logits, Estimator.TOPK, 32), truncated)
    assert torch.equal(estimate(real_logits, "tail", 32), corrected)
    with pytest.raises(ValueError):
        estimate(real_logits, "nope")


def test_triton_kernels_match_torch_under_interpreter(real_logits, tmp_path):
    # The interpreter must be chosen before triton is imported: run in a fresh process.
    rows = torch.cat([real_logits[:6], real_logits[6:12] / 3.0, real_logits[12:18] * 3.0])
    rows[0, 5000:30000] = float("-inf")
    torch.save(rows, tmp_path / "rows.pt")
    script = textwrap.dedent(f"""
        import torch
        from kernels import entropy, entropy_triton
        rows = torch.load({str(tmp_path / 'rows.pt')!r})
        for splits in (None, 1, 3):  # a row folded by one program, or by several merged afterwards
            exact = entropy_triton.exact_entropy(rows, block=1024, splits=splits)
            assert torch.allclose(exact, entropy.exact_entropy(rows), atol=1e-4), (splits, exact)
        for k in (1, 20, 64):
            got = entropy_triton.topk_entropies(rows, k)
            want = entropy.topk_entropies(rows, k)
            for g, w in zip(got, want):
                assert torch.allclose(g, w, atol=1e-4), (k, g, w)
        print("triton-ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "triton-ok" in result.stdout, result.stderr[-3000:]
