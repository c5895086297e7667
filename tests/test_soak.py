"""The soak benchmark's bookkeeping (loadtest/soak.py): how an answer is classified and how memory growth
is read, on answers and samples built by hand (the run itself is a benchmark, not a test)."""
from __future__ import annotations

import json

from loadtest.soak import POISON, _outcome, summarize

ERROR = {"error": {"message": "m", "type": "t", "param": None, "code": 400}}


def test_answers_are_classified_the_way_clients_must_be_answered():
    assert _outcome(400, {}, ERROR, expect_400=True) == "rejected"
    assert _outcome(400, {}, {"detail": "x"}, expect_400=True) == "wrong"  # not an OpenAI error object
    assert _outcome(500, {}, ERROR, expect_400=True) == "wrong"
    assert _outcome(200, {}, {}, expect_400=False) == "ok"
    assert _outcome(503, {"retry-after": "5"}, ERROR, expect_400=False) == "shed"
    assert _outcome(503, {}, ERROR, expect_400=False) == "server_error"  # shedding must say when to retry
    assert _outcome(422, {}, ERROR, expect_400=False) == "wrong"


def test_every_poison_input_is_a_request_a_client_could_send():
    for path, raw in POISON:
        assert path.startswith("/v1/") and raw.startswith(b"{")
    assert any(b"\\ud800" in raw for _, raw in POISON)  # a lone surrogate, escaped as JSON allows
    json.loads(POISON[0][1])


def test_memory_growth_is_read_after_the_warm_up_per_process():
    memory = [{"t": t, "pid": 7, "role": "EntropicWorker", "rss_mib": 100 + t} for t in (0, 30, 60, 90, 120)]
    memory += [{"t": 60, "pid": 8, "role": "engine", "rss_mib": 500.0}]  # one sample after warm-up: no trend
    # A replacement engine started midway loads its model over its first samples: its warm-up is its own
    memory += [{"t": t, "pid": 9, "role": "engine", "rss_mib": rss} for t, rss in ((60, 250), (90, 3500), (120, 3510))]
    summary = summarize([{"kind": "chat", "sent": 1.0, "outcome": "ok", "e2e": 0.5}], memory, minutes=2)
    assert set(summary["rss_after_warmup"]) == {"7", "9"}
    g = summary["rss_after_warmup"]["7"]
    assert (g["from_mib"], g["to_mib"]) == (130, 220) and abs(g["growth"] - (220 / 130 - 1)) < 1e-9
    g = summary["rss_after_warmup"]["9"]
    assert (g["from_mib"], g["to_mib"], g["over_s"]) == (3500, 3510, 30)
    assert summary["outcomes"] == {"ok": {"chat": 1}} and summary["windows"][0]["chat_p50_s"] == 0.5
