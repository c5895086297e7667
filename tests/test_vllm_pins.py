"""Our adapters touch vLLM internals written for vllm 0.32.0; these fail loudly when vLLM changes.

(The engine-object path ``engine_core.engine_core.model_executor.driver_worker.worker.model_runner
.input_batch.logitsprocs`` is checked by every engine start: EngineRunner raises if it is gone.)
"""
import inspect

import vllm


def test_vllm_version_is_the_one_the_adapters_were_written_for():
    assert vllm.__version__ == "0.32.0", (
        "workers/sampling.py, workers/engine.py, workers/prompts.py and deployments/protocol.py were written "
        f"against vllm 0.32.0; re-check them against {vllm.__version__} and update this pin")


def test_logits_processor_interface():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
    from vllm.v1.sample.logits_processor import interface

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
    assert "self.priority" in inspect.getsource(Request.__lt__)
