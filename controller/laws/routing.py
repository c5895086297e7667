"""Where a new request should go: the replica expected to serve it soonest (pure).

Each replica reports ``running``, ``waiting``, ``max_num_seqs`` and ``step_s`` (recent engine step
time). A new request there waits behind everything admitted and queued: expected delay ≈
step_s · load / max_num_seqs, with load = max(ongoing, running + waiting): ``ongoing`` is what this
router has sent there and not yet seen finish (exact and immediate), the report covers requests
from other routers (but lags by a stats period). Replicas with no report yet rank last.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence


def expected_delay(stats: dict[str, Any], ongoing: int = 0) -> float:
    capacity = max(1, int(stats.get("max_num_seqs", 1)))
    load = max(ongoing, stats.get("running", 0) + stats.get("waiting", 0))
    return max(stats.get("step_s", 0.0), 1e-3) * load / capacity


def rank(candidates: Sequence[tuple[Hashable, dict[str, Any] | None, int]]) -> list[Hashable]:
    """Candidate ids, soonest first: (id, stats or None, ongoing) each."""
    known = [(expected_delay(s, n), i, c) for i, (c, s, n) in enumerate(candidates) if s]
    unknown = [c for c, s, _ in candidates if not s]
    return [c for _, _, c in sorted(known, key=lambda x: (x[0], x[1]))] + unknown
