"""loadtest/bench_serve.py's server configurations (the benchmark itself needs two servers and minutes)."""
import argparse

import pytest

from loadtest.bench_serve import (
    METRICS,
    SETS,
    between_pairs,
    merged,
    output_lengths,
    pair_servers,
    parse_variant,
    parse_variant_env,
    render,
    summarize,
    variant_servers,
)


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


def test_the_serve_pairs_differ_from_defaults_only_in_rays_throughput_switch():
    ours, theirs = pair_servers("defaults", "/models/m", "m", "bfloat16")
    assert ours.env == {}  # make serve as shipped: serve_env sets what it sets itself
    for pair, switch in (("serve-stock", "0"), ("serve-throughput", "1")):
        other, other_theirs = pair_servers(pair, "/models/m", "m", "bfloat16")
        assert other.argv == ours.argv and other.config == ours.config and other_theirs == theirs
        assert other.env == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": switch}


def test_our_servers_are_compared_only_between_pairs_that_ran_the_same_vllm_serve():
    def cell(pair, server, r, tps, ttft):
        return {"pair": pair, "set": "short", "server": server, "round": r, "output_throughput": tps,
                "mean_ttft_ms": ttft, "mean_tpot_ms": 50.0, "p99_itl_ms": None}

    cells = [cell("defaults", "vllm", 0, 150.0, 900.0), cell("defaults", "ours", 0, 160.0, 800.0),
             cell("serve-stock", "vllm", 0, 140.0, 950.0), cell("serve-stock", "ours", 0, 176.0, 600.0),
             cell("defaults", "ours", 1, 100.0, 1000.0), cell("serve-stock", "ours", 1, 110.0, 900.0),
             cell("matched", "ours", 0, 1.0, 1.0), cell("matched", "vllm", 0, 1.0, 1.0)]
    same = ["python", "-m", "loadtest.vllm_cli", "serve", "m"]
    result = {"cells": cells, "servers": {"defaults/vllm": same, "serve-stock/vllm": list(same),
                                          "matched/vllm": same + ["--dtype", "bfloat16"]}}
    between = between_pairs(result)
    # matched ran another vllm serve: its ours is not set against defaults'
    assert list(between) == ["serve-stock/short / defaults/short"]
    ratios = between["serve-stock/short / defaults/short"]
    # ours / ours in each round, whatever vllm did in either pair; a metric a cell lacks gives no ratio
    assert ratios["output_throughput"] == [1.1, 1.1]
    assert ratios["mean_ttft_ms"] == [0.75, 0.9]
    assert ratios["mean_tpot_ms"] == [1.0, 1.0] and ratios["p99_itl_ms"] == []


def test_a_set_that_ends_at_eos_reports_each_servers_output_length_and_the_outputs_the_limit_cut():
    data = SETS["natural-eos"]
    assert not data.ignore_eos and SETS["natural"].ignore_eos
    limit = int(data.output_len)
    # a failed request reports 0 tokens: it is no output of the model's length
    assert output_lengths([100, 300, limit, 0], limit) == {"mean_output_len": (100 + 300 + limit) / 3,
                                                          "outputs_at_limit": 1}
    assert output_lengths([0], limit) == {"mean_output_len": None, "outputs_at_limit": 0}

    def cell(server, r, tps, rps, length, cut):
        return {**dict.fromkeys(METRICS, 50.0), "pair": "defaults", "set": "natural-eos", "server": server,
                "round": r, "output_throughput": tps, "request_throughput": rps, "completed": 16, "failed": 0,
                "mean_output_len": length, "outputs_at_limit": cut}

    cells = [cell("vllm", 0, 10.0, 0.1, 100.0, 0), cell("ours", 0, 12.0, 0.2, 60.0, 0),
             cell("ours", 1, 11.0, 0.3, 40.0, 1), cell("vllm", 1, 10.0, 0.2, 120.0, 2)]
    result = {"command": "c", "date": "d", "rounds": 2, "cells": cells, "summary": summarize(cells),
              "startup_s": {}, "servers": {}, "machine": {"cpu": "x", "cpu_flags": "avx2", "cores": 2,
                                                           "memory_gib": 1, "torch": "t", "vllm": "v",
                                                           "cpu_dtype_auto": "bfloat16"}}
    text = render(result)
    # ours wrote less per request: requests per second tells what tokens per second cannot
    assert "- defaults/natural-eos: requests/s 2.00x, 1.50x; ours 60 tokens (0 of 16 at the limit), 40 tokens " \
           "(1 of 16 at the limit); vllm 100 tokens (0 of 16 at the limit), 120 tokens (2 of 16 at the limit)" in text
    assert f"ending at the model's end of sequence: at most {limit} tokens in `natural-eos`" in text
    assert "--ignore-eos" not in text  # no set of this run had a fixed length


def test_the_itl_shape_counts_bunched_and_long_gaps_of_every_request():
    """Two requests' gaps, median 40 ms: a token 15 ms behind the one before it came bunched behind a late one;
    one 100 ms after it waited over two steps."""
    from loadtest.bench_serve import itl_shape

    shape = itl_shape([[0.040, 0.040, 0.065, 0.015], [0.040, 0.100, 0.040, 0.040]])
    assert shape == {"itl_under_half_median": 1 / 8, "itl_over_twice_median": 1 / 8}
    assert itl_shape([]) == {} and itl_shape([[]]) == {}  # failed requests only: nothing to say

    def cell(server, under):
        return {**dict.fromkeys(METRICS, 50.0), "pair": "matched", "set": "short", "server": server, "round": 0,
                "completed": 48, "failed": 0, "itl_under_half_median": under, "itl_over_twice_median": 0.01}

    cells = [cell("vllm", 0.0), cell("ours", 0.045)]
    result = {"command": "c", "date": "d", "rounds": 1, "cells": cells, "summary": summarize(cells),
              "startup_s": {}, "servers": {}, "machine": {"cpu": "x", "cpu_flags": "avx2", "cores": 2,
                                                           "memory_gib": 1, "torch": "t", "vllm": "v",
                                                           "cpu_dtype_auto": "bfloat16"}}
    text = render(result)
    assert "- matched/short ours: TPOT 50; median ITL 50; gaps under half the median 4.5%, over twice it 1.0%" in text
    assert "- matched/short vllm: TPOT 50; median ITL 50; gaps under half the median 0.0%, over twice it 1.0%" in text


def test_a_variant_is_matched_with_our_fields_merged_against_matched_s_vllm_serve():
    name, fields = parse_variant('no-borrow={"engine": {"borrow_serving_cores": false}}')
    assert name == "no-borrow"
    ours, theirs = variant_servers(name, {name: fields}, "/models/m", "m", "bfloat16")
    matched_ours, matched_theirs = pair_servers("matched", "/models/m", "m", "bfloat16")
    assert ours.config == merged(matched_ours.config, fields) and ours.config["engine"]["borrow_serving_cores"] is False
    assert (theirs.argv, theirs.env) == (matched_theirs.argv, matched_theirs.env)
    assert variant_servers("defaults", {name: fields}, "/models/m", "m", "bfloat16")[0].config is None
    for bad in ("matched={}", "x", "x={", "x=[1]", "={}"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_a_variant_on_defaults_is_make_serve_with_our_fields_against_vllm_serve_s_defaults():
    fields = {"engine": {"max_num_seqs": 128}}
    ours, theirs = variant_servers("big", {"big": fields}, "/models/m", "m", "bfloat16", base="defaults")
    shipped_ours, shipped_theirs = pair_servers("defaults", "/models/m", "m", "bfloat16")
    assert ours.config == fields and ours.argv == shipped_ours.argv
    assert (theirs.argv, theirs.env) == (shipped_theirs.argv, shipped_theirs.env)


def test_vllm_serve_runs_once_a_round_for_the_pairs_that_give_it_the_same_command(monkeypatch, tmp_path):
    """The round loop of main() with its servers and client replaced (named fakes: a real round starts
    servers for minutes): which servers start, in which order, and which cells each pair gets."""
    import loadtest.bench_serve as bench
    import loadtest.machine
    import workers.model_store

    started: list[str] = []
    published: dict = {}

    def start(self, workdir, log):
        started.append(log.name.removesuffix(".log"))
        return None, 1.0

    def drive(server, data, model_name, model_dir, workdir, tag, natural, client_args):
        assert client_args == ["--top-p", "0.9"], "both servers' client gets the same sampling options"
        return {**dict.fromkeys(METRICS, 1.0), "failed": 1 if server.label == "vllm" else 0,
                "output_throughput": 100.0 if server.label == "vllm" else 100.0 + len(started)}

    monkeypatch.setattr(bench.Server, "start", start)
    monkeypatch.setattr(bench, "stop", lambda proc, port: None)
    monkeypatch.setattr(bench, "drive", drive)
    monkeypatch.setattr(workers.model_store, "resolve_model", lambda model: "/models/m")
    monkeypatch.setattr(loadtest.machine, "publish",
                        lambda module, argv, out, result, render: published.update(result, text=render(
                            {**result, "command": "c", "date": "d", "machine": {
                                "cpu": "x", "cpu_flags": "avx2", "cores": 2, "memory_gib": 1, "torch": "t",
                                "vllm": "v", "cpu_dtype_auto": "bfloat16"}})))
    assert bench.main(["--pairs", "defaults", "matched", "--sets", "short", "--rounds", "2", "--variant",
                       'no-borrow={"engine": {"borrow_serving_cores": false}}', "--client-args", "--top-p 0.9",
                       "--out", str(tmp_path / "r")]) == 0
    # the variant reuses matched's vllm serve in each round; the order within each pair alternates by round
    assert started == ["defaults-vllm-0", "defaults-ours-0", "matched-vllm-0", "matched-ours-0", "no-borrow-ours-0",
                       "defaults-ours-1", "defaults-vllm-1", "matched-ours-1", "matched-vllm-1", "no-borrow-ours-1"]
    cells = published["cells"]
    shared = [c for c in cells if c["pair"] == "no-borrow" and c["server"] == "vllm"]
    assert [c["measured_in"] for c in shared] == ["matched", "matched"] and [c["round"] for c in shared] == [0, 1]
    assert published["summary"]["no-borrow/short"]["output_throughput"]["ratios"] == [1.05, 1.1]
    assert "no-borrow/short / matched/short" in between_pairs(published)
    assert "no-borrow's are matched's runs" in published["text"]
    assert "Failed requests: 4 " in published["text"]  # vllm serve's failures counted once per run
    assert "Every request with `--top-p 0.9`" in published["text"]


def test_a_variant_s_environment_reaches_its_server_only(monkeypatch, tmp_path):
    """main() with servers and client replaced (named fakes, as above): the environment each server starts
    with, where one variant adds a variable for ours."""
    import loadtest.bench_serve as bench
    import loadtest.machine
    import workers.model_store

    envs: dict[str, dict] = {}

    def start(self, workdir, log):
        envs[log.name.removesuffix(".log")] = dict(self.env)
        return None, 1.0

    monkeypatch.setattr(bench.Server, "start", start)
    monkeypatch.setattr(bench, "stop", lambda proc, port: None)
    monkeypatch.setattr(bench, "drive", lambda *a: {**dict.fromkeys(METRICS, 1.0), "failed": 0})
    monkeypatch.setattr(workers.model_store, "resolve_model", lambda model: "/models/m")
    monkeypatch.setattr(loadtest.machine, "publish", lambda *a: None)
    assert bench.main(["--pairs", "matched", "--sets", "long", "--rounds", "1", "--variant", "huge-pages={}",
                       "--variant-env", "huge-pages=THP_MEM_ALLOC_ENABLE=1", "--out", str(tmp_path / "r")]) == 0
    assert envs["huge-pages-ours-0"] == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert "THP_MEM_ALLOC_ENABLE" not in envs["matched-ours-0"] and "THP_MEM_ALLOC_ENABLE" not in envs["matched-vllm-0"]
    assert "huge-pages-vllm-0" not in envs  # the variant's vllm serve is matched's
    assert parse_variant_env("a=K=v=w") == ("a", "K", "v=w")
    for bad in ("a", "a=K", "=K=v", "a==v"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant_env(bad)
    with pytest.raises(SystemExit):  # an environment for a variant that is not there
        bench.main(["--pairs", "matched", "--variant-env", "typo=K=v", "--out", str(tmp_path / "r")])
