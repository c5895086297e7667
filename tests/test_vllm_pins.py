"""Our adapters touch vLLM internals written for vllm 0.32.0; these fail loudly when vLLM changes.

Every touch of a vLLM internal, and where it is:
- ``workers/engine.py``: the in-process engine's objects, ``LLMEngine.engine_core`` (an InprocClient)
  ``.engine_core`` (the EngineCore) ``.scheduler`` and ``.model_executor.driver_worker.worker
  .model_runner.input_batch.logitsprocs`` (checked at every engine start: EngineRunner raises if the
  processor is not found there; the scheduler path by ``test_inprocess_engine_object_path``);
  ``SamplingParams.verify``; ``VLLMClientError``.
- ``workers/engine.py``: migration reads ``Scheduler.requests`` (``status``, ``num_computed_tokens``) under the
  id ``LLMEngine.add_request`` returns.
- ``workers/engine.py``: ``EngineRunner.kv_tokens`` reads ``Scheduler.kv_cache_manager.block_pool``
  (``get_num_free_blocks``, ``num_gpu_blocks``) and ``Scheduler.block_size``.
- ``workers/scheduler.py``: ``Scheduler`` internals (``_preempt_request``, ``running``, ``waiting``,
  ``PriorityRequestQueue._heap``, ``max_num_running_reqs``); the prefill gate calls ``schedule`` with
  ``throttle_prefills`` (vLLM's data-parallel prefill cadence), clears ``prefill_capacity_bound``, and times
  steps from ``schedule`` to ``update_from_output``.
- ``workers/sampling.py``: the logits-processor interface and ``BatchUpdate``.
- ``workers/pruned_attention*.py``, ``workers/pruning_plan.py``, ``workers/vllm_plugin.py``: the CPU and
  Triton attention backends and the backend registry (``tests/test_pruning_gpu_path.py`` too).
- ``workers/prompts.py``, ``deployments/protocol.py``: the OpenAI protocol models, ``to_sampling_params``,
  ``resolve_chat_template_kwargs``.
- ``workers/engine.py``, ``deployments/logprobs.py``: ``RequestOutput`` logprobs (per position, token id ->
  ``Logprob``, the position's own token first) and ``EngineArgs.logprobs_mode``.
- ``workers/step_threads.py``: ``wrap_forward`` wraps the in-process executor's ``execute_model`` and reads
  ``SchedulerOutput.total_num_scheduled_tokens`` and its requests' ``num_computed_tokens``.
- ``workers/engine.py``: ``processed_logprobs_only_when_asked`` wraps the model runner's ``Sampler.sample`` and
  sets its ``topk_topp_sampler.logprobs_mode`` per step from ``SamplingMetadata.max_num_logprobs`` and
  ``logprob_token_ids`` (behaviour: ``tests/test_sampler_logprobs.py``).
- ``workers/decode_weights.py``: wraps ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which the
  CPU linear and embedding methods import when they process loaded weights, sets the layer's ``cpu_linear`` (called
  as ``(x, weight, bias)``), builds vLLM's oneDNN GEMM (``create_onednn_mm``, ``torch.ops._C.onednn_mm``) for large
  steps, and reads ``VllmConfig.additional_config``.
- ``workers/cpu_sampler.py``: ``inverse_cdf_sampling`` replaces the instance's ``TopKTopPSampler.forward`` where
  it is ``forward_cpu``, called as ``(logits, generators, k, p)``, and returns what ``forward_cpu`` returns
  beside the tokens for each ``logprobs_mode``; it reproduces ``apply_top_k_top_p``'s rule, with per-row ``k``
  of the vocabulary size and ``p`` of 1 meaning off, as ``InputBatch`` fills them (behaviour, against vLLM's
  own function: ``tests/test_cpu_sampler.py``), and, given the input batch's ``LogitsProcessors``, takes over
  ``MinPLogitsProcessor.apply`` and reproduces its rule in the same draw; ``sparse_penalties`` replaces the
  instance's ``Sampler.apply_penalties``, called as ``(logits, sampling_metadata, output_token_ids)``, and reproduces
  ``apply_all_penalties`` (behaviour, bit for bit against it: ``tests/test_cpu_penalties.py``).
"""
import inspect
import os
from pathlib import Path

import pytest
import torch
import vllm


def test_vllm_version_is_the_one_the_adapters_were_written_for():
    assert vllm.__version__ == "0.32.0", (
        "workers/sampling.py, workers/engine.py, workers/prompts.py and deployments/protocol.py were written "
        f"against vllm 0.32.0; re-check them against {vllm.__version__} and update this pin")


def test_logits_processor_interface():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality, interface

    assert {f for f in BatchUpdate.__dataclass_fields__} >= {"removed", "added", "moved"}
    assert interface.AddedRequest.__args__[0] is int and len(interface.AddedRequest.__args__) == 4
    assert {m.name for m in MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}
    assert list(inspect.signature(LogitsProcessor.__init__).parameters) == [
        "self", "vllm_config", "device", "is_pin_memory"]
    for name in ("apply", "is_argmax_invariant", "update_state", "validate_params"):
        assert hasattr(LogitsProcessor, name), name


def test_engine_and_protocol_entry_points():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.engine.llm_engine import LLMEngine

    for cls in (ChatCompletionRequest, CompletionRequest):
        params = list(inspect.signature(cls.to_sampling_params).parameters)
        assert params[:3] == ["self", "max_tokens", "default_sampling_params"], params
    add = inspect.signature(LLMEngine.add_request).parameters
    assert list(add)[:4] == ["self", "request_id", "prompt", "params"]
    for name in ("step", "abort_request", "has_unfinished_requests", "get_tokenizer"):
        assert hasattr(LLMEngine, name), name


def test_logprobs_entry_points():
    from vllm import EngineArgs, SamplingParams
    from vllm.logprobs import Logprob, append_logprobs_for_next_position

    assert {"logprob", "rank", "decoded_token"} <= set(Logprob.__dataclass_fields__)
    position: list = []
    append_logprobs_for_next_position(position, [7, 3, 7], [-2.0, -0.1, -2.0], ["a", "b", "a"], rank=2, num_logprobs=2)
    assert list(position[0]) == [7, 3] and position[0][7].rank == 2  # own token first, then the top ranks
    assert "logprobs_mode" in EngineArgs.__dataclass_fields__
    # Prompt logprobs must be asked for when the params are built: vLLM then skips reading the prefix cache for
    # the request. Set afterwards (as this repository once did), the cached positions were never computed and
    # came back as uninitialized token ids, which crashed detokenization on repeated long prompts.
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    late = SamplingParams()
    late.prompt_logprobs = 0
    assert late.skip_reading_prefix_cache is False


def test_tokenize_entry_points():
    """/tokenize and /detokenize take vLLM's request models and load the tokenizer as vLLM's engine does."""
    from vllm.entrypoints.serve.tokenize.protocol import (
        DetokenizeRequest,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
        TokenizeResponse,
    )
    from vllm.tokenizers import get_tokenizer

    assert {"messages", "add_generation_prompt", "add_special_tokens", "return_token_strs", "chat_template_kwargs",
            "continue_final_message", "tools"} <= set(TokenizeChatRequest.model_fields)
    assert {"prompt", "add_special_tokens", "return_token_strs"} <= set(TokenizeCompletionRequest.model_fields)
    assert set(DetokenizeRequest.model_fields) >= {"tokens", "model"}
    assert set(TokenizeResponse.model_fields) == {"count", "max_model_len", "tokens", "token_strs"}
    assert list(inspect.signature(get_tokenizer).parameters)[0] == "tokenizer_name"


def test_our_processor_is_a_vllm_logits_processor():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    from workers.sampling import EntropicLogitsProcessor

    assert issubclass(EntropicLogitsProcessor, LogitsProcessor)
    assert not EntropicLogitsProcessor(None, None, False).is_argmax_invariant()


def test_scheduler_internals_we_use():
    from vllm.v1.core.sched.request_queue import PriorityRequestQueue
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    assert list(inspect.signature(Scheduler._preempt_request).parameters)[:3] == ["self", "request", "timestamp"]
    for name in ("schedule", "add_request"):
        assert hasattr(Scheduler, name), name
    source = inspect.getsource(Scheduler.__init__)
    for attribute in ("self.running", "self.waiting", "self.kv_holding_waiting", "self.max_num_running_reqs",
                      "self.requests"):
        assert attribute in source, attribute
    assert "_heap" in inspect.getsource(PriorityRequestQueue.__init__)
    # EngineRunner.kv_tokens: the KV headroom the controller's dispatch reads
    assert "self.kv_cache_manager" in source and "self.block_size" in source
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert "self.block_pool" in inspect.getsource(KVCacheManager.__init__)
    assert "self.num_gpu_blocks" in inspect.getsource(BlockPool.__init__) and hasattr(BlockPool, "get_num_free_blocks")
    assert "self.priority" in inspect.getsource(Request.__lt__)
    # workers/scheduler.py puts decodes first because the budget goes to `running` in list order, and
    # tells a chunked prefill from a decode by what is left to compute
    assert "while req_index < len(self.running) and token_budget > 0" in inspect.getsource(Scheduler.schedule)
    assert "self.num_computed_tokens" in inspect.getsource(Request.__init__) and hasattr(Request, "num_tokens")
    # the prefill gate: vLLM defers prefill chunks and admissions on a throttled step while some running request
    # decodes, unless its last release step left requests waiting (prefill_capacity_bound), which we clear
    assert list(inspect.signature(Scheduler.schedule).parameters) == ["self", "throttle_prefills"]
    schedule = inspect.getsource(Scheduler.schedule)
    assert "throttle_prefills and not self.prefill_capacity_bound" in schedule
    assert "self.prefill_capacity_bound = False" in source
    assert list(inspect.signature(Scheduler.update_from_output).parameters) == [
        "self", "scheduler_output", "model_runner_output"]


def test_what_migration_reads_of_a_waiting_request():
    """workers/engine.py (``_is_unstarted``): the id ``LLMEngine.add_request`` returns names the request in
    ``Scheduler.requests``; a request the scheduler has not started is ``RequestStatus.WAITING`` with
    ``num_computed_tokens`` 0, and ``Scheduler.waiting`` is falsy when empty."""
    from vllm.v1.core.sched.request_queue import RequestQueue
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.request import Request, RequestStatus

    source = inspect.getsource(LLMEngine.add_request)
    assert inspect.signature(LLMEngine.add_request).return_annotation in ("str", str)
    assert "req_id = request.request_id" in source and "return req_id" in source
    init = inspect.getsource(Request.__init__)
    assert "self.status = RequestStatus.WAITING" in init and "self.num_computed_tokens = 0" in init
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    assert hasattr(RequestQueue, "__bool__")


def test_pruned_attention_adapter_points():
    from importlib.metadata import entry_points

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        CPUAttentionMetadata,
        CPUAttentionMetadataBuilder,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: F401
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("entropic_pruning") == "workers.vllm_plugin:register", "run `make install` (editable install)"
    assert AttentionBackendEnum.CPU_ATTN
    assert list(inspect.signature(CPUAttentionMetadataBuilder.build).parameters) == [
        "self", "common_prefix_len", "common_attn_metadata", "fast_build"]
    assert list(inspect.signature(CPUAttentionBackendImpl.forward).parameters)[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    fields = set(CPUAttentionMetadata.__dataclass_fields__)
    assert {"block_table", "seq_lens", "scheduler_metadata", "max_seq_len", "query_start_loc"} <= fields
    common = set(CommonAttentionMetadata.__dataclass_fields__)
    assert {"req_idx", "is_prefilling", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound",
            "block_table_tensor", "slot_mapping", "num_actual_tokens"} <= common
    builder_source = inspect.getsource(CPUAttentionMetadataBuilder)
    for attribute in ("self.isa", "self.block_size", "self.num_heads", "self.num_kv_heads", "self.head_dim",
                      "self.window_size", "self.is_cross_attention", "self.is_encoder_only_attention",
                      "self.kv_cache_dtype"):
        assert attribute in builder_source, attribute
    # the cache write is an op of its own, so a pure-decode step's forward can be our kernel alone
    assert CPUAttentionBackend.forward_includes_kv_cache_update is False
    # the builder sets each layer's ISA, which the impl's forward (and our key_cache_view) reads
    assert "layer.isa = self.isa" in builder_source and "layer.isa" in inspect.getsource(CPUAttentionBackendImpl.forward)
    # logits processors see the batch before the step's attention metadata is built (workers/pruning_state.py)
    update = inspect.getsource(GPUModelRunner._update_states)
    assert "refresh_metadata" in update


def test_triton_attention_adapter_points():
    """workers/pruned_attention_gpu.py subclasses vLLM's TRITON_ATTN backend (the GPU path)."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
        TritonAttentionMetadata,
        TritonAttentionMetadataBuilder,
    )

    assert AttentionBackendEnum.TRITON_ATTN and AttentionCGSupport.NEVER.value == 0
    assert TritonAttentionBackend.get_name() == "TRITON_ATTN"
    assert list(inspect.signature(TritonAttentionMetadataBuilder.build).parameters) == [
        "self", "common_prefix_len", "common_attn_metadata", "fast_build"]
    assert list(inspect.signature(TritonAttentionImpl.forward).parameters)[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    assert {"block_table", "seq_lens", "max_seq_len"} <= set(TritonAttentionMetadata.__dataclass_fields__)
    forward = inspect.getsource(TritonAttentionImpl.forward)
    # the cache layout compacted_table reads, and the fields the kernel takes from the metadata
    assert "kv_cache.transpose(1, 2)" in forward and "split(hs, dim=-1)" in forward
    assert "seqused_k = attn_metadata.seq_lens" in forward and "block_table = attn_metadata.block_table" in forward
    assert "self._is_per_token_head_quant" in forward
    builder = inspect.getsource(TritonAttentionMetadataBuilder)
    assert "self.block_size" in builder and "_cudagraph_support" in builder


@pytest.mark.parametrize("isa,dtype", [("vec", "float32"), ("vec", "bfloat16"), ("amx", "bfloat16")])
def test_cpu_key_cache_layout_is_what_the_pruner_reads(isa, dtype, vllm_cpu_ops):
    """Write keys with vLLM's own CPU cache op and read them back through key_cache_view.

    "amx" is the layout vLLM's CPU attention uses for bf16 on CPUs with AMX tiles; its cache op is
    plain stores, so it runs (and is pinned) on any CPU whose vLLM library has the AMX kernels."""
    import torch

    from workers.pruned_attention import SUPPORTED_ISAS, key_cache_view

    ops = vllm_cpu_ops

    assert isa in SUPPORTED_ISAS
    if isa == "amx" and not torch.cpu._is_avx512_bf16_supported():
        # vLLM loads its AVX2 or AVX512 library here, neither built with the AMX kernels
        pytest.skip("no AVX512-BF16 on this CPU: vLLM's library with the AMX kernels is not the one loaded")
    blocks, kv_heads, block_size, d = 4, 3, 64, 64
    kv_cache = torch.zeros(blocks, kv_heads, block_size, 2 * d, dtype=getattr(torch, dtype))
    tokens = 90
    key = torch.randn(tokens, kv_heads, d).to(kv_cache.dtype)
    value = torch.randn(tokens, kv_heads, d).to(kv_cache.dtype)
    slots = torch.arange(block_size, block_size + tokens, dtype=torch.int64)  # blocks 1 and 2
    view = kv_cache.view(blocks, kv_heads, 2 * block_size, d)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    keys = key_cache_view(kv_cache, isa)
    assert keys.data_ptr() == kv_cache.data_ptr()  # a view: summaries read the cache in place
    keys = keys.reshape(blocks, kv_heads, block_size, d)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(keys[slot // block_size, :, slot % block_size], key[i]), (isa, slot)


def test_request_validation_entry_points():
    """workers.engine.EngineRunner.validate and workers.prompts run vLLM's own request checks."""
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.exceptions import VLLMClientError, VLLMValidationError
    from vllm.renderers.hf import resolve_chat_template_kwargs

    assert list(inspect.signature(SamplingParams.verify).parameters) == [
        "self", "model_config", "speculative_config", "structured_outputs_config", "tokenizer"]
    assert issubclass(VLLMValidationError, VLLMClientError) and not issubclass(VLLMValidationError, ValueError)
    assert {"speculative_config", "structured_outputs_config"} <= set(VllmConfig.__dataclass_fields__)
    assert list(inspect.signature(resolve_chat_template_kwargs).parameters)[:3] == [
        "tokenizer", "chat_template", "chat_template_kwargs"]


def test_inprocess_engine_object_path():
    """workers/engine.py reaches the scheduler of an in-process engine through these attributes."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine

    assert "self.engine_core = EngineCore(" in inspect.getsource(InprocClient.__init__)
    assert "self.scheduler" in inspect.getsource(EngineCore.__init__)
    assert "self.model_executor" in inspect.getsource(EngineCore.__init__)
    assert "self.engine_core = EngineCoreClient.make_client(" in inspect.getsource(LLMEngine.__init__)


def test_stat_logging_we_call_between_steps():
    """workers/engine.py refreshes vLLM's gauges after the last request of a replica is aborted."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerManager

    assert "self.logger_manager" in inspect.getsource(LLMEngine.__init__)
    assert list(inspect.signature(StatLoggerManager.record).parameters)[:3] == [
        "self", "scheduler_stats", "iteration_stats"]
    assert hasattr(Scheduler, "make_stats")


def test_cpu_aot_load_still_lacks_finalize_loading():
    """workers/aot_cache.py gives torch's bundled AOTAutograd callable a no-op ``finalize_loading``: on CPU vLLM
    compiles with plain inductor (DYNAMO_TRACE_ONCE), whose saved artifact's compiled function is that class,
    and vLLM's loader calls the method, which only its own backend's function has. When any side changes,
    see whether the shim is still needed (tests/test_compiled_default.py checks that a second start loads)."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    from vllm.compilation import decorators
    from vllm.platforms import cpu

    assert "compiled_fn.finalize_loading(" in inspect.getsource(decorators._try_load_aot_compiled_fn)
    platform = inspect.getsource(cpu)
    assert 'else "inductor"' in platform and "CompilationMode.DYNAMO_TRACE_ONCE" in platform
    assert "finalize_loading" not in inspect.getsource(BundledAOTAutogradSerializableCallable)


def test_the_aot_shim_adds_a_no_op_once():
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    from workers.aot_cache import load_inductor_artifacts

    load_inductor_artifacts()
    installed = vars(Bundled)["finalize_loading"]
    load_inductor_artifacts()
    assert vars(Bundled)["finalize_loading"] is installed

    class Artifact:
        def serialize(self):
            return b""

    assert Bundled(Artifact()).finalize_loading(object()) is None


def test_engine_env_keeps_a_users_overrides(monkeypatch):
    from workers.engine import engine_process_env

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = engine_process_env(2, 3)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # the user's choice
    assert env["OMP_NUM_THREADS"] == "2"  # ours: the replica's thread count is the config's
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_engine_env_keeps_default_pages_unless_a_user_asks_for_huge_ones():
    """workers/engine.py sets torch's THP_MEM_ALLOC_ENABLE to its default: in a process started with the engine's
    environment a large tensor (as the KV cache and the weights are) lies on the kernel's default pages, as in
    `vllm serve`, and a user's THP_MEM_ALLOC_ENABLE=1 puts it on transparent huge pages. Child processes: torch
    reads the variable once, at its first allocation."""
    import subprocess
    import sys

    from workers.engine import engine_process_env

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off in this kernel: nothing for torch to ask for")
    probe = ("import torch\n"
             "def huge_kib():\n"
             "    with open('/proc/self/smaps_rollup') as f:\n"
             "        return next(int(line.split()[1]) for line in f if line.startswith('AnonHugePages'))\n"
             "before = huge_kib()\n"
             "t = torch.ones(64 << 20, dtype=torch.uint8)\n"
             "print(huge_kib() - before)\n")

    def huge_kib_of_64_mib(env: dict[str, str]) -> int:
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])

    ours = engine_process_env(1, 1, overrides={})
    assert ours["THP_MEM_ALLOC_ENABLE"] == "0"
    if "[madvise]" in mode.read_text():  # in "always" mode every large mapping gets huge pages anyway
        assert huge_kib_of_64_mib(ours) < 32 << 10
    users = engine_process_env(1, 1, overrides={"THP_MEM_ALLOC_ENABLE": "1"})
    assert users["THP_MEM_ALLOC_ENABLE"] == "1"
    assert huge_kib_of_64_mib(users) >= 32 << 10  # most of the tensor; the rest can be its unaligned ends


def test_each_engine_of_a_process_starts_with_its_own_environment():
    """vllm 0.32.0 caches its environment once an engine has started; workers.engine.configure_process_env
    lifts that cache, and a value it set for an earlier engine is not taken for a user's override. Run in a
    child process: this one's environment is the rest of the suite's."""
    import subprocess
    import sys

    from vllm.v1.engine.core import EngineCore

    assert "enable_envs_cache()" in inspect.getsource(EngineCore.__init__)
    child = ("import vllm.envs as e; from workers.engine import configure_process_env as c; c(2, 1); "
             "a = e.VLLM_CPU_KVCACHE_SPACE; e.enable_envs_cache(); c(2, 4); print(a, e.VLLM_CPU_KVCACHE_SPACE)")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    ours = subprocess.run([sys.executable, "-c", child], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert ours.stdout.split() == ["1", "4"], ours.stderr[-2000:]
    users = subprocess.run([sys.executable, "-c", child], cwd=root, env={**env, "VLLM_CPU_KVCACHE_SPACE": "3"},
                           capture_output=True, text=True, timeout=120)
    assert users.stdout.split() == ["3", "3"], users.stderr[-2000:]


def test_the_sampler_calls_its_top_k_top_p_stage_with_the_mode_it_holds():
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    assert list(inspect.signature(Sampler.sample).parameters) == [
        "self", "logits", "sampling_metadata", "logprobs_mode_override"]
    assert "self.topk_topp_sampler(" in inspect.getsource(Sampler.sample)
    assert "self.logprobs_mode" in inspect.getsource(TopKTopPSampler.forward_cpu)
    assert {"max_num_logprobs", "logprob_token_ids"} <= set(SamplingMetadata.__dataclass_fields__)


def test_the_cpu_top_k_top_p_stage_our_sampler_replaces():
    """workers/cpu_sampler.py: on x86 CPUs the stage's ``forward`` is ``forward_cpu``, the sampler calls it with
    the step's generators, top-k and top-p, and with both None it samples the logits as given (Gumbel-max, or
    float64 noise when ``use_fp64_gumbel``), returning the logits or their log-softmax per ``logprobs_mode``."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    stage = TopKTopPSampler("raw_logprobs")
    assert stage.forward.__func__ is TopKTopPSampler.forward_cpu and stage.use_fp64_gumbel is False
    assert list(inspect.signature(TopKTopPSampler.forward_cpu).parameters) == ["self", "logits", "generators", "k", "p"]
    sample = inspect.getsource(Sampler.sample)
    assert ("self.topk_topp_sampler(\n            logits,\n            sampling_metadata.generators,\n"
            "            sampling_metadata.top_k,\n            sampling_metadata.top_p,\n        )") in sample
    logits = torch.randn(2, 8)
    assert apply_top_k_top_p(logits, None, None) is logits
    source = inspect.getsource(TopKTopPSampler.forward_cpu)
    for line in ('if self.logprobs_mode == "processed_logits":', "logits_to_return = logits\n",
                 'elif self.logprobs_mode == "processed_logprobs":',
                 "logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)", "fused_gumbel_argmax"):
        assert line in source, line
    assert source.index("logits = apply_top_k_top_p(logits, k, p)") < source.index("logits_to_return")


def test_the_penalties_our_kernel_reproduces():
    """kernels/csrc/penalties.c: repetition first (divide a positive logit, multiply another, for tokens of the
    prompt or the output), then frequency times the output count, then presence; the sampler calls its
    (static) ``apply_penalties`` through the instance with the step's output ids."""
    from vllm._custom_ops import apply_repetition_penalties_torch
    from vllm.model_executor.layers import utils
    from vllm.v1.sample.sampler import Sampler

    body = inspect.getsource(utils.apply_penalties)
    order = ["apply_repetition_penalties(logits, prompt_mask, output_mask, repetition_penalties)",
             "logits -= frequency_penalties.unsqueeze(dim=1) * output_bin_counts",
             "logits -= presence_penalties.unsqueeze(dim=1) * output_mask"]
    assert all(line in body for line in order) and sorted(order, key=body.index) == order
    repetition = inspect.getsource(apply_repetition_penalties_torch)
    assert "scaling = torch.where(logits > 0, 1.0 / penalties, penalties)" in repetition
    assert "logits = self.apply_penalties(logits, sampling_metadata, output_token_ids)" in inspect.getsource(
        Sampler.apply_logits_processors)
    assert list(inspect.signature(Sampler.apply_penalties).parameters) == ["logits", "sampling_metadata",
                                                                           "output_token_ids"]


def test_the_top_k_top_p_rule_our_kernel_reproduces():
    """kernels/csrc/sample.c keeps, per row, the tokens at or above the k-th largest logit, then those below less
    than p of the renormalized mass, with k = vocabulary size and p = 1 meaning off (InputBatch's encoding)."""
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch

    rule = inspect.getsource(topk_topp_sampler.apply_top_k_top_p_pytorch)
    for line in ("top_k_mask = logits_sort < top_k_mask", "probs_sort = logits_sort.softmax(dim=-1)",
                 "top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)", "top_p_mask[:, -1] = False"):
        assert line in rule, line
    assert "logits.masked_fill_(logits < top_k_mask" in inspect.getsource(topk_topp_sampler.apply_top_k_only)
    assert topk_topp_sampler.HAS_TRITON is False, "vLLM's CPU top-k/top-p would not be the PyTorch rule"
    add = inspect.getsource(InputBatch.add_request)
    for line in ("self.top_p_cpu[req_index] = sampling_params.top_p", "if 0 < top_k < self.vocab_size:",
                 "top_k = self.vocab_size", "self.top_k_cpu[req_index] = top_k"):
        assert line in add, line


def test_the_min_p_processor_our_draw_takes_over():
    """workers/cpu_sampler.py folds vLLM's min-p into the kernel's threshold: ``Sampler.sample`` applies the
    argmax-invariant processors right before its top-k/top-p stage and nowhere else (min-p is the last of vLLM's
    own processors, so the last of those unless a user adds one); the processor keeps ``min_p_count`` and its rows'
    ``min_p`` as a [rows, 1] tensor, 0 meaning off, and masks the tokens whose probability is below min_p times the
    row's largest."""
    from vllm.v1.sample import logits_processor
    from vllm.v1.sample.logits_processor import MinPLogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    sample = inspect.getsource(Sampler.sample)
    loop = "for processor in sampling_metadata.logitsprocs.argmax_invariant:\n            logits = processor.apply(logits)"
    assert loop in sample and sample.index(loop) < sample.index("self.topk_topp_sampler(")
    between = sample[sample.index(loop) + len(loop):sample.index("self.topk_topp_sampler(")]
    assert "logits" not in between.replace("random_sampled, processed_logprobs = ", ""), between
    others = [p for p in Path(inspect.getfile(Sampler)).parent.rglob("*.py")
              if "logitsprocs.argmax_invariant" in p.read_text() and p.name != "sampler.py"]
    assert others == [], others
    assert logits_processor.BUILTIN_LOGITS_PROCESSORS[-1] is MinPLogitsProcessor  # custom ones come after
    update, apply = inspect.getsource(MinPLogitsProcessor.update_state), inspect.getsource(MinPLogitsProcessor.apply)
    for line in ("if not self.min_p_count:", "max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)",
                 "adjusted_min_p = max_probabilities.mul_(self.min_p)",
                 "invalid_token_mask = probability_values < adjusted_min_p"):
        assert line in apply, line
    assert "self.min_p.unsqueeze_(1)" in update and "self.min_p = self.min_p_device[:size]" in update


def test_the_forward_pass_our_step_threads_widen():
    """workers/step_threads.py wraps the in-process executor's ``execute_model``: called by ``EngineCore.step``
    on the stepping thread with the step's ``SchedulerOutput`` (its scheduled tokens, and the cached tokens of
    its new and running requests), run there by
    the uniprocess executor; and it calls torch's C binding because vLLM's CPU worker replaces
    ``torch.set_num_threads`` by a warning."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert "self.model_executor.execute_model(scheduler_output, non_block=True)" in inspect.getsource(EngineCore.step)
    assert {"total_num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs"} <= set(
        SchedulerOutput.__dataclass_fields__)
    assert "num_computed_tokens" in CachedRequestData.__dataclass_fields__
    assert "num_computed_tokens" in NewRequestData.__dataclass_fields__
    assert list(inspect.signature(UniProcExecutor.execute_model).parameters) == ["self", "scheduler_output", "non_block"]
    assert "result = run_method(self.driver_worker, method, args, kwargs)" in inspect.getsource(
        UniProcExecutor.collective_rpc)  # in the calling thread, blocking or not
    assert "torch.set_num_threads = skip_set_num_threads" in inspect.getsource(CPUWorker.init_device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4)])
def test_our_decode_kernel_matches_vllms_cpu_attention(heads, kv_heads, dtype, vllm_cpu_ops):
    """kernels.cpu_decode_attention reads the "vec" cache vLLM's own op writes and answers what vLLM's CPU
    attention answers for one query token per row: scattered blocks, partial last blocks, peaked and flat
    softmaxes. In bf16 the tolerance is two bf16 steps at the outputs' size: the kernel rounds probabilities to
    bf16 before the products with the values (vLLM's "vec" kernel keeps them float32), and both round the
    output; in float32 (no rounding but the order of sums and the exponential's) two steps of 2^-14."""
    from kernels.cpu_decode_attention import available, decode_attention, parallel

    ops = vllm_cpu_ops
    if not available(dtype):
        pytest.skip(f"the kernel does not run on a {dtype} cache on this CPU: vLLM's attention is used")
    torch.manual_seed(heads * 10 + kv_heads)
    d, block_size, rows = 64, 64, 5
    seq_lens = torch.tensor([1, 63, 64, 700, 1950], dtype=torch.int32)
    per_row = [-(-int(n) // block_size) for n in seq_lens]
    blocks = sum(per_row) + 3
    # slots no token was written to hold nan for our kernel: a block's unwritten slots may hold anything, and must
    # weigh nothing (vLLM's kernel reads them: it gets the cache with zeros there, as vLLM allocates it)
    kv_cache = torch.full((blocks, kv_heads, block_size, 2 * d), float("nan"), dtype=dtype)
    key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * block_size, d).chunk(2, dim=2)
    order = torch.randperm(blocks)[: sum(per_row)]
    table = torch.zeros(rows, max(per_row) + 2, dtype=torch.int32)
    start = 0
    for r, count in enumerate(per_row):
        table[r, :count] = order[start: start + count]
        start += count
        n = int(seq_lens[r])
        slots = (table[r, :count].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        keys = torch.randn(n, kv_heads, d).to(dtype)
        values = torch.randn(n, kv_heads, d).to(dtype)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec",
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    # rows 0-2 near-uniform softmaxes, rows 3-4 peaked ones (queries 6x larger)
    query = (torch.randn(rows, heads, d) * torch.tensor([1, 1, 1, 6, 6])[:, None, None]).to(dtype)
    scale = d ** -0.5
    query_start = torch.arange(rows + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    expected = torch.zeros(rows, heads, d, dtype=dtype)
    zeroed_keys, zeroed_values = kv_cache.nan_to_num(0.0).view(blocks, kv_heads, 2 * block_size, d).chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=zeroed_keys, value_cache=zeroed_values, output=expected, query_start_loc=query_start,
        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto")
    answers = []
    threads = torch.get_num_threads()
    try:
        # one engine thread, and two: rows and KV heads spread over the OpenMP pool (where the build has OpenMP;
        # a serial build declines with two threads, leaving the step to vLLM's kernel)
        for count in (1, 2):
            torch.set_num_threads(count)
            ours = torch.full((rows, heads * d), float("nan"), dtype=dtype)
            if decode_attention(query, ours, kv_cache, table, seq_lens, scale):
                answers.append(ours)
            else:
                assert count > 1 and not parallel()
        # more threads than (row, KV head) pairs: vLLM's kernel, which splits sequences between threads too
        torch.set_num_threads(rows * kv_heads + 1)
        assert not decode_attention(query, torch.empty(rows, heads * d, dtype=dtype), kv_cache, table,
                                    seq_lens, scale)
    finally:
        torch.set_num_threads(threads)
    # each (row, KV head) is computed by one thread the same way, whatever the count
    assert all(torch.equal(answers[0], other) for other in answers[1:])
    ours = answers[0].view(rows, heads, d).float()
    unit = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -14
    step = unit * expected.float().abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -6)  # a step at the size
    assert ((ours - expected.float()).abs() <= 2 * step).all()
    # and the comparison can fail: another row's answer is far off
    assert not ((ours.roll(1, dims=0) - expected.float()).abs() <= 2 * step).all()


def test_the_cpu_gemm_dispatch_our_decode_weights_wrap(vllm_cpu_ops):
    """workers/decode_weights.py: vLLM's CPU linear and LM-head methods import the dispatch from its module when
    they call it (so the plugin's wrapper is the one they get), it takes (layer, remove_weight), and the oneDNN GEMM
    our op falls back to keeps its handler in a tensor and writes into a given output."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    call = "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm"
    for method in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        assert call in inspect.getsource(method.process_weights_after_loading), method
    assert "layer.cpu_linear(x, weight, bias)" in inspect.getsource(utils.cpu_unquantized_gemm)
    assert list(inspect.signature(utils.dispatch_cpu_unquantized_gemm).parameters) == ["layer", "remove_weight"] \
        or getattr(utils.dispatch_cpu_unquantized_gemm, "_entropic", False)
    assert issubclass(ParallelLMHead, VocabParallelEmbedding)
    assert "additional_config" in VllmConfig.__dataclass_fields__
    weight = torch.randn(24, 16)
    handler = vllm_cpu_ops.create_onednn_mm(weight.t(), 32)
    assert handler.handler_tensor.dtype == torch.int64 and (handler.k, handler.n) == (16, 24)
    x, out = torch.randn(3, 16), torch.empty(3, 24)
    torch.ops._C.onednn_mm(out, x, None, handler.handler_tensor)
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)
