"""Typed configuration: defaults, validation errors that name the field, Serve YAML loading."""
import pytest
import yaml
from pydantic import ValidationError

from deployments.config import AppConfig
from deployments.server import parse_args
from workers.control_params import SamplingControl


def test_defaults_serve_the_default_model():
    config = AppConfig()
    assert config.model == "default" and config.model_name == "SmolLM2-135M-Instruct"
    assert config.engine.engine_kwargs("/m", "name")["disable_log_stats"] is False
    # GPU replicas with pruning use the Triton backend our pruned path subclasses; CPU ones their own
    assert config.engine.engine_kwargs("/m", "name", on_gpu=True, pruning=True)["attention_backend"] == "TRITON_ATTN"
    assert "attention_backend" not in config.engine.engine_kwargs("/m", "name", on_gpu=False, pruning=True)
    assert "attention_backend" not in config.engine.engine_kwargs("/m", "name", on_gpu=True, pruning=False)
    # CPU + pruning: the block size the pruning benchmark found fastest, unless the config names one
    assert config.engine.engine_kwargs("/m", "name", pruning=True)["block_size"] == 64
    assert "block_size" not in config.engine.engine_kwargs("/m", "name", pruning=False)
    named = AppConfig.model_validate({"engine": {"block_size": 128}})
    assert named.engine.engine_kwargs("/m", "name", pruning=True)["block_size"] == 128


def test_one_replica_takes_the_burst_vllm_bench_serve_sends_by_default_before_it_sheds():
    """`vllm bench serve` sends 1000 requests at once unless told otherwise, and vllm serve queues them all:
    one replica as shipped (its ongoing requests plus Serve's queue for it) holds that many before a 503."""
    from vllm.benchmarks.datasets.datasets import DEFAULT_NUM_PROMPTS

    config = AppConfig.model_validate({"num_replicas": 1})
    assert config.ongoing_bound() + config.queue_bound() >= DEFAULT_NUM_PROMPTS == 1000
    # a larger batch than shipped still fills: the replica takes twice its slots unless told otherwise
    assert AppConfig.model_validate({"engine": {"max_num_seqs": 512}}).ongoing_bound() == 1024
    assert AppConfig.model_validate({"max_ongoing_requests": 24}).ongoing_bound() == 24


@pytest.mark.parametrize("raw,field", [
    ({"num_replicas": 0}, "num_replicas"),
    ({"engine": {"max_num_seqs": "many"}}, "engine.max_num_seqs"),
    ({"sampling": {"estimator": "guess"}}, "sampling.estimator"),
    ({"sampling": {"t_min": 2.0, "t_max": 1.0}}, "sampling"),
    ({"no_such_option": 1}, "no_such_option"),
    ({"dispatch": {"enabled": True}, "max_queued_requests": 8}, "max_queued_requests"),  # 8 < 128 batch slots
    ({"dispatch": {"max_queued": 0}}, "dispatch.max_queued"),
])
def test_invalid_values_name_the_field(raw, field):
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(raw)
    assert field in str(info.value)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_engine_parallelism_is_refused_at_start_naming_the_field(name):
    """A replica runs its engine in one process (docs/design/engine-embedding.md)."""
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({"engine": {"extra": {name: 2}}})
    assert f"engine.extra.{name}=2" in str(info.value) and "engine-embedding.md" in str(info.value)
    assert AppConfig.model_validate({"engine": {"extra": {name: 1}}})  # one is what a replica runs


def test_telemetry_off_turns_every_control_layer_off():
    from workers.config import ReplicaConfig

    plain = ReplicaConfig(telemetry=False).layers_on()
    assert not (plain.sampling.enabled or plain.pruning.enabled or plain.scheduling.enabled)
    assert ReplicaConfig().layers_on() == ReplicaConfig()


def test_the_prefill_gate_holds_5_decode_steps_by_default_and_takes_a_time_or_null_instead():
    from controller.config import SchedulingConfig

    assert SchedulingConfig().prefill_gate_policy().target_decode_steps == 5.0
    assert SchedulingConfig(tpot_target_decode_steps=None).prefill_gate_policy() is None
    assert SchedulingConfig(tpot_target_ms=700).prefill_gate_policy().target_gap_s == pytest.approx(0.7)
    both = SchedulingConfig(tpot_target_decode_steps=5, tpot_target_ms=700).prefill_gate_policy()
    assert both.target_gap_s == pytest.approx(0.7) and both.target_decode_steps is None  # the time wins
    with pytest.raises(ValidationError):
        SchedulingConfig(tpot_target_decode_steps=1)


def test_request_overrides_merge_over_defaults():
    defaults = SamplingControl(target_entropy=2.0, t_max=3.0)
    merged = defaults.merged({"target_entropy": 1.0})
    assert merged.target_entropy == 1.0 and merged.t_max == 3.0
    with pytest.raises(ValidationError):
        defaults.merged({"t_min": 3.5})


def test_serve_config_file_loads_into_the_typed_config(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [{
        "name": "entropic", "import_path": "deployments.app:build_app", "route_prefix": "/",
        "args": {"num_replicas": 2, "sampling": {"target_entropy": 1.5}, "engine": {"max_model_len": 4096}},
    }]}))
    _, config = parse_args(["--config", str(path)])
    assert config.num_replicas == 2 and config.sampling.target_entropy == 1.5
    assert config.engine.max_model_len == 4096


def test_command_line_rejects_invalid_config(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("num_replicas: -1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    assert "num_replicas" in capsys.readouterr().err


def test_model_store_rejects_a_path_without_a_model(tmp_path):
    from workers.model_store import ModelPreparationError, resolve_model

    with pytest.raises(ModelPreparationError, match="no config.json"):
        resolve_model(str(tmp_path))
