"""loadtest/bench_serve.py's server configurations (the benchmark itself needs two servers and minutes)."""
from loadtest.bench_serve import SETS, merged, pair_servers


def test_ours_config_overrides_one_engine_field_and_keeps_the_pairs_others():
    ours, theirs = pair_servers("matched", "/models/m", "m", "bfloat16")
    config = merged(ours.config, {"engine": {"borrow_min_context": 12288}, "telemetry": False})
    assert config["engine"] == {**ours.config["engine"], "borrow_min_context": 12288}
    assert config["telemetry"] is False
    assert "borrow_min_context" not in ours.config["engine"]  # the pair's own config is left as it was
    assert theirs.config is None  # vllm serve takes command-line arguments only


def test_ours_config_on_the_defaults_pair_is_the_whole_config():
    ours, _ = pair_servers("defaults", "/models/m", "m", "bfloat16")
    assert ours.config is None  # make serve as shipped
    assert merged(ours.config or {}, {"engine": {"borrow_min_context": 12288}}) == {
        "engine": {"borrow_min_context": 12288}}


def test_no_two_sets_draw_the_same_random_prompts():
    # one server serves every set of a round: a set drawn from another's seed would hit its prefix cache
    assert len({s.seed for s in SETS.values()}) == len(SETS)


def test_serve_stock_differs_from_defaults_only_in_rays_throughput_switch():
    ours, theirs = pair_servers("defaults", "/models/m", "m", "bfloat16")
    stock, stock_theirs = pair_servers("serve-stock", "/models/m", "m", "bfloat16")
    assert stock.argv == ours.argv and stock.config == ours.config
    assert ours.env == {}  # make serve as shipped: serve_env applies Ray's throughput mode itself
    assert stock.env == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    assert stock_theirs == theirs
