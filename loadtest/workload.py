"""Prompts written for this repo, with checkable answers, shared by the tests and the ablation harness.

Three kinds, as the paper's §6 workload: instruction following with a one-word answer,
long-context retrieval (a passkey hidden in filler at a chosen depth) and free-form generation.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TOKENS_PER_FILLER = 24  # SmolLM2's tokenizer: FILLER is 24 tokens

CHECKABLE = [
    ("What is the capital of France? Answer in one word.", "paris"),
    ("What is the capital of Japan? Answer in one word.", "tokyo"),
    ("What is the capital of Italy? Answer in one word.", "rome"),
    ("What is the capital of Germany? Answer in one word.", "berlin"),
    ("Which planet is known as the Red Planet? Answer in one word.", "mars"),
    ("What colour is the sky on a clear day? Answer in one word.", "blue"),
    ("What is the largest ocean on Earth? Answer in a few words.", "pacific"),
    ("What gas do plants take in from the air? Answer in a few words.", "carbon dioxide"),
]

FREE_FORM = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a busy market in a small town on a summer morning.",
    "Write a letter from a fox to the farmer whose chickens it keeps watching.",
    "Tell the story of a train that runs through the mountains at night.",
]


def passkey_prompt(filler_reps: int, depth: float, key: int) -> str:
    """A completion prompt of about 24 * filler_reps tokens with the key at ``depth`` (0..1)."""
    parts = [FILLER] * filler_reps
    parts.insert(int(filler_reps * depth), f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return ("There is a pass key hidden in this text. Find it and remember it.\n" + "".join(parts)
            + "What is the pass key? The pass key is")


@dataclass(frozen=True)
class Job:
    name: str
    kind: str  # "checkable" | "passkey" | "free_form"
    prompt: str  # chat user message for checkable/free_form, raw completion prompt for passkey
    answer: str | None
    max_tokens: int
    seed: int


def mixed_jobs(passkey_tokens: tuple[int, ...] = (2000, 4000), free_tokens: int = 96) -> list[Job]:
    jobs = [Job(f"checkable-{i}", "checkable", q, a, 16, 100 + i) for i, (q, a) in enumerate(CHECKABLE)]
    for i, tokens in enumerate(t for t in passkey_tokens for _ in range(2)):
        key = 20011 + 7919 * i
        depth = 0.3 if i % 2 == 0 else 0.7
        jobs.append(Job(f"passkey-{tokens}-{depth}", "passkey", passkey_prompt(tokens // TOKENS_PER_FILLER, depth, key),
                        str(key), 12, 200 + i))
    jobs += [Job(f"free-{i}", "free_form", p, None, free_tokens, 300 + i) for i, p in enumerate(FREE_FORM)]
    return jobs


def distinct_n(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repetition_rate(tokens: list[int], n: int = 4) -> float:
    """Share of n-grams that already appeared earlier in the same output."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
        total += 1
    return repeats / total if total else 0.0


def drawn_jobs(count: int, seed: int, passkey_tokens: tuple[int, ...] = (2000, 4000),
               free_tokens: int = 96) -> list[Job]:
    """``count`` jobs in mixed_jobs' proportions (half questions with one-word answers, a quarter passkeys, a
    quarter free-form), drawn with ``seed``: questions and free-form prompts with replacement, each passkey with
    a key, depth and length of its own. Different seeds give different draws of the same workload."""
    rng = random.Random(seed)
    passkeys = frees = count // 4
    jobs = [Job(f"checkable-{i}", "checkable", *rng.choice(CHECKABLE), 16, seed) for i in range(count - 2 * passkeys)]
    for i in range(passkeys):
        tokens, depth, key = rng.choice(passkey_tokens), round(rng.uniform(0.1, 0.9), 2), rng.randrange(10000, 100000)
        jobs.append(Job(f"passkey-{i}", "passkey", passkey_prompt(tokens // TOKENS_PER_FILLER, depth, key), str(key),
                        12, seed))
    jobs += [Job(f"free-{i}", "free_form", rng.choice(FREE_FORM), None, free_tokens, seed) for i in range(frees)]
    return jobs
