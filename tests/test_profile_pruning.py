"""loadtest/profile_pruning.py's accounting, on timer readings whose answer is known (the tool itself runs
two engines at long context)."""
import pytest

from loadtest.profile_pruning import Timers, per_step, summarize


def test_a_step_is_the_long_runs_increase_less_the_short_runs_and_nested_timers_are_split():
    before = {"attention": 1.0, "layer total": 2.0, "selection total": 0.5, "summaries": 0.1}
    # the 1-token run: 0.2 s of attention (its prefill), nothing pruned
    short = {"attention": 1.2, "layer total": 2.2, "selection total": 0.5, "summaries": 0.1}
    # 11 tokens = 10 decode steps more: 30 ms attention, 4 ms selection of which 1 ms summaries, 40 ms per layer call
    long = {"attention": 1.2 + 0.2 + 0.3, "layer total": 2.2 + 0.2 + 0.4, "selection total": 0.54, "summaries": 0.11}
    step = per_step(before, short, long, steps=10)
    assert step["attention"] == pytest.approx(0.03)
    assert step["summaries"] == pytest.approx(0.001)
    assert step["selection"] == pytest.approx(0.003)
    assert step["layer wrapper"] == pytest.approx(0.04 - 0.03 - 0.003 - 0.001)
    assert "layer total" not in step and "selection total" not in step


def test_the_bound_is_the_plain_steps_rest_plus_the_kept_share_of_its_attention():
    plain = {"rows": [{"context": 4000, "prompt_tokens": 3990, "batch": 8, "step_s": s, "parts_s": {"attention": a},
                       "kept_ratio": 1.0} for s, a in ((0.2, 0.1),)]}
    parts = {"attention": 0.03, "selection": 0.01, "summaries": 0.0, "layer wrapper": 0.002, "plan": 0.001,
             "logits processor": 0.002}
    pruned = {"rows": [{"context": 4000, "prompt_tokens": 3990, "batch": 8, "step_s": 0.15, "parts_s": parts,
                        "kept_ratio": 0.25}]}
    [row] = summarize([{"plain": plain, "pruned": pruned}])
    assert row["plain_rest_s"] == pytest.approx(0.1)
    assert row["bound_kept_attention_s"] == pytest.approx(0.1 + 0.25 * 0.1)
    assert row["pruned_parts_s"]["rest"] == pytest.approx(0.15 - 0.045)


def test_timers_wrap_a_class_function_once_and_keep_its_result():
    class Base:
        def f(self, x):
            return x + 1

    class Child(Base):
        def f(self, x):
            return super().f(x) * 2

    timers = Timers()
    timers.wrap(Base, "f", "base")
    timers.wrap(Child, "f", "child")
    assert Child().f(1) == 4
    assert set(timers.seconds) == {"base", "child"} and timers.seconds["child"] >= timers.seconds["base"] > 0


def test_a_context_too_short_to_prune_has_no_selection_and_no_wrapper_cost():
    before = {"attention": 1.0, "layer total": 1.1}
    short = {"attention": 1.1, "layer total": 1.2}
    long = {"attention": 1.1 + 0.1 + 0.5, "layer total": 1.2 + 0.1 + 0.5}  # 10 steps of 50 ms, all in vLLM's forward
    step = per_step(before, short, long, steps=10)
    assert step["selection"] == 0.0 and step["layer wrapper"] == pytest.approx(0.0, abs=1e-12)


def test_the_ceiling_at_a_kept_fraction_is_the_rest_plus_that_share_of_attention_and_caps_the_bounds_gain():
    from loadtest.bench_pruning import kept_ceiling

    for rest, attention in ((0.04, 0.035), (0.035, 0.05), (0.03, 0.3)):
        plain = rest + attention
        bound = plain / rest
        for kept in (0.1, 0.25, 0.5):
            ceiling = kept_ceiling(bound, kept)
            assert ceiling == pytest.approx(plain / (rest + kept * attention))
            assert (ceiling - 1) / (bound - 1) < 1 - kept
    assert kept_ceiling(2.0, 1.0) == pytest.approx(1.0) and kept_ceiling(2.0, 0.0) == pytest.approx(2.0)
