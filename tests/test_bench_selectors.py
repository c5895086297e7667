"""loadtest/bench_selectors.py's prompts and accounting, on inputs whose answers are known (the benchmark
itself runs the engine over long prompts for many minutes)."""
import math
from pathlib import Path

import pytest
import torch

from loadtest.bench_selectors import TASKS, Case, _forced_metrics, _render, correct, make_cases, plot, summarize
from loadtest.plots import replot
from loadtest.stats import wilson


def test_every_task_has_its_cases_and_each_asks_for_what_it_hid():
    cases = make_cases(2000, 3, seed=0)
    assert sorted({c.task for c in cases}) == sorted(TASKS) and len(cases) == 3 * len(TASKS)
    for case in cases:
        if case.task == "two_part":
            assert case.answer[:3] in case.prompt and case.answer[3:] in case.prompt
        elif case.answer is not None:
            assert case.prompt.count(case.answer) >= 1
    needles = [c for c in cases if c.task == "needles"]
    assert [c.prompt.rsplit("What is the ", 1)[1].split()[0] for c in needles] == ["first", "second", "third"]
    assert make_cases(2000, 3, seed=0) == cases and make_cases(2000, 3, seed=1) != cases


def test_an_answer_counts_with_spaces_or_separators_between_its_digits_but_not_a_decoy():
    case = Case("two_part", 2000, "", "123456", 12)
    assert correct(case, " 123 456.") and correct(case, "123,456") and not correct(case, " 123 457")


def test_wilson_interval_contains_the_proportion_and_narrows_with_more_cases():
    lo, hi = wilson(8, 10)
    assert lo < 0.8 < hi
    lo2, hi2 = wilson(80, 100)
    assert hi2 - lo2 < hi - lo
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)


def test_forced_metrics_compare_each_position_after_the_prefills():
    dense = {0: torch.log_softmax(torch.tensor([0.0, 5.0]), -1), 1: torch.log_softmax(torch.tensor([2.0, 0.0]), -1),
             2: torch.log_softmax(torch.tensor([0.0, 1.0]), -1)}
    same = dict(dense)
    flipped = {**dense, 2: torch.log_softmax(torch.tensor([1.0, 0.0]), -1)}
    agreement, kl = _forced_metrics([dense, dense], [same, flipped])
    assert agreement == [1.0, 0.5]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 0


def _row(selector, budget, task, context, **values):
    return {"selector": selector, "budget": budget, "task": task, "context": context, "prompt_tokens": context,
            "seconds": 1.0, **values}


def test_summary_pools_cases_over_contexts_per_selector_and_budget():
    row = _row
    rows = [row("dense", None, "passkey", 2000, kept=1.0, correct=[True, True], same_as_dense=[True, True]),
            row("dense", None, "natural", 2000, kept=1.0, agreement=[1.0], kl=[0.0]),
            row("entropy", 0.25, "passkey", 2000, kept=0.4, correct=[True, False], same_as_dense=[True, False]),
            row("entropy", 0.25, "passkey", 4000, kept=0.3, correct=[True, True], same_as_dense=[True, True]),
            row("entropy", 0.25, "natural", 2000, kept=0.5, agreement=[0.9, 0.7], kl=[0.1, 0.3]),
            row("fixed", 0.25, "natural", 2000, kept=0.5, agreement=[0.9, 0.8], kl=[0.05, 0.1])]
    dense, entropy, fixed = summarize(rows)
    assert dense["selector"] == "dense" and entropy["selector"] == "entropy"
    assert entropy["kept"] == pytest.approx((0.4 + 0.3 + 0.5) / 3)
    assert entropy["accuracy"]["passkey"][0] == pytest.approx(0.75)
    assert entropy["same_as_dense"][0] == pytest.approx(0.75)
    assert entropy["kl"][0] == pytest.approx(0.2) and entropy["kl"][1] < 0.2 < entropy["kl"][2]
    assert entropy["kept_by_context"] == {"2000": pytest.approx(0.45), "4000": pytest.approx(0.3)}
    assert math.isnan(dense["kl"][1])  # one case: no interval
    assert fixed["selector"] == "fixed" and "kl_minus_fixed" not in fixed
    assert entropy["kl_minus_fixed"][0] == pytest.approx(((0.1 - 0.05) + (0.3 - 0.1)) / 2)  # paired by case


def test_a_saved_result_is_replotted_and_its_markdown_embeds_the_curves(tmp_path):
    import json

    from loadtest.machine import describe

    rows = [_row("dense", None, "natural", 2000, kept=1.0, agreement=[1.0, 1.0], kl=[0.0, 0.0])]
    for budget, kept in [(0.1, 0.5), (0.5, 0.8)]:
        for selector in ("entropy", "fixed", "quest"):
            rows.append(_row(selector, budget, "natural", 2000, kept=kept, agreement=[0.9, 0.8], kl=[0.1, 0.2]))
    result = {"command": "python -m loadtest.bench_selectors", "date": "now", "machine": describe(),
              "dtype": "float32", "block_size": 64, "max_step": None, "prompt_surprisal": False,
              "contexts": [2000], "cases": 2, "budgets": [0.1, 0.5], "summary": summarize(rows), "rows": rows}
    out = tmp_path / "selectors"
    (tmp_path / "selectors.json").write_text(json.dumps(result))
    replot(str(out), plot, _render)
    saved = json.loads((tmp_path / "selectors.json").read_text())
    assert [Path(p).name for p in saved["plots"]] == ["selectors-kl.png", "selectors-agreement.png"]
    for name in ("selectors-kl.png", "selectors-agreement.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in (tmp_path / "selectors.md").read_text()


def test_speed_against_dense_is_the_geometric_mean_of_its_per_group_ratios():
    rows = [{**_row("dense", None, "passkey", 2000, kept=1.0, correct=[True], same_as_dense=[True]), "seconds": 2.0},
            {**_row("dense", None, "passkey", 4000, kept=1.0, correct=[True], same_as_dense=[True]), "seconds": 4.0},
            {**_row("fixed", 0.5, "passkey", 2000, kept=0.5, correct=[True], same_as_dense=[True]), "seconds": 1.0},
            {**_row("fixed", 0.5, "passkey", 4000, kept=0.5, correct=[True], same_as_dense=[True]), "seconds": 8.0}]
    dense, fixed = summarize(rows)
    assert dense["speed_vs_dense"] == pytest.approx(1.0)
    assert fixed["speed_vs_dense"] == pytest.approx(math.sqrt(2.0 * 0.5))  # 2x faster on one, 2x slower on the other
