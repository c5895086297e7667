"""loadtest/bench_pruning.py's prompts (the benchmark itself runs two engines at long context for minutes)."""
from loadtest.bench_pruning import filler_prompts

BLOCK = 16  # a KV block smaller than any served here (64 with pruning on CPU, vLLM's 128): rows must differ in it


def test_shared_prompts_differ_only_in_their_last_line_and_distinct_ones_from_the_first_block(hf_model):
    _, tokenizer = hf_model
    shared = [tokenizer.encode(p) for p in filler_prompts(tokenizer, 1000, 3)]
    distinct = [tokenizer.encode(p) for p in filler_prompts(tokenizer, 1000, 3, distinct=True)]
    for rows in (shared, distinct):
        assert all(900 <= len(r) <= 1100 for r in rows)
    body = len(shared[0]) - 20  # the question line is under 20 tokens
    assert shared[0][:body] == shared[1][:body] == shared[2][:body]
    assert len({tuple(r[:BLOCK]) for r in distinct}) == 3
