"""lm-evaluation-harness, as people evaluate a vLLM server, against the served app (real engines, default model).

Its ``local-completions`` model scores a loglikelihood task through ``echo`` with ``logprobs`` on the completions
API (token-id prompts, ``max_tokens`` 1) and runs generate-until tasks; ``local-chat-completions`` runs the
generate-until task through the chat API. The tasks are local files (no hub): capitals of 20 countries, as
4-way multiple choice (chance 0.25) and as free generation (chance ~0).
"""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "lm_eval" / "capitals.jsonl"
PROMPT = "Q: What is the capital of Peru?\\nA: Lima\\nQ: What is the capital of {{{{country}}}}?\\nA:"
DATASET = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{prompt}"
"""
MULTIPLE_CHOICE = """task: capitals_choice
output_type: multiple_choice
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATE = """task: capitals_generate
output_type: generate_until
doc_to_target: capital
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
filter_list:
  - name: last_word
    filter:
      - function: regex
        regex_pattern: '(\\w+)\\W*$'
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
"""


def _evaluate(model: str, base_url: str, served_model: str, model_dir: Path, tasks_dir: Path, tasks: list[str],
              **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model, tasks=tasks, task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=False,
        model_args={"model": served_model, "base_url": base_url, "tokenizer": str(model_dir),
                    "tokenizer_backend": "huggingface", "num_concurrent": 8, "max_retries": 1, "timeout": 120},
        **kwargs)
    return results["results"]


def test_lm_eval_scores_above_chance_through_both_apis(server, served_model, model_dir, tmp_path):
    dataset = DATASET.format(data=DATA, prompt=PROMPT.format())
    (tmp_path / "capitals_choice.yaml").write_text(MULTIPLE_CHOICE + dataset)
    (tmp_path / "capitals_generate.yaml").write_text(GENERATE + dataset)

    scores = _evaluate("local-completions", f"{server}/v1/completions", served_model, model_dir, tmp_path,
                       ["capitals_choice", "capitals_generate"])
    # greedy on fixed prompts (measured: 1.0, 0.9, and 0.45 through chat); batching can move a close call, so the
    # bars sit well below those and well above chance
    assert scores["capitals_choice"]["acc,none"] >= 0.6, scores
    assert scores["capitals_generate"]["exact_match,last_word"] >= 0.6, scores

    chat = _evaluate("local-chat-completions", f"{server}/v1/chat/completions", served_model, model_dir, tmp_path,
                     ["capitals_generate"], apply_chat_template=True)
    assert chat["capitals_generate"]["exact_match,last_word"] >= 0.25, chat
