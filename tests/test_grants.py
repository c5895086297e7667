"""Decode-step grant bookkeeping (pure)."""
import pytest

from controller.laws.grants import GrantPolicy, renew, runnable, spend, to_renew


def test_top_slots_are_renewed_and_others_keep_their_lease():
    policy = GrantPolicy(slots=2, lease_steps=4)
    leases = renew({"a": 3.0, "b": 2.0, "c": 1.0}, {}, policy)
    assert leases == {"a": 4, "b": 4, "c": 0}
    spend(leases, ["a", "b"])
    # c rises above b: c gets a lease, b keeps the rest of its own (not revoked mid-lease)
    leases = renew({"a": 3.0, "b": 0.5, "c": 2.5}, leases, policy)
    assert leases == {"a": 4, "b": 3, "c": 4}
    for _ in range(3):
        spend(leases, ["b"])
    assert leases["b"] == 0 and runnable(["a", "b", "c"], leases) == ["a", "c"]


def test_finished_sequences_drop_out_and_spending_stops_at_zero():
    policy = GrantPolicy(slots=1, lease_steps=2)
    leases = renew({"a": 1.0, "b": 2.0}, {}, policy)
    spend(leases, ["b", "b", "b", "a"])
    assert leases == {"a": 0, "b": 0}
    assert renew({"a": 1.0}, leases, policy) == {"a": 2}


def test_no_grant_source_means_everyone_runs():
    assert renew({"a": 1.0, "b": 2.0}, {}, GrantPolicy()) == {"a": 8, "b": 8}
    assert runnable(["a", "b"], {}) == ["a", "b"]  # nobody holds a lease: never stall


def test_invalid_policy_rejected():
    with pytest.raises(ValueError):
        GrantPolicy(slots=0)
    with pytest.raises(ValueError):
        GrantPolicy(lease_steps=0)


def test_a_grant_decision_made_elsewhere_renews_exactly_those_leases():
    """The controller decides (to_renew over its π); the replica applies it to the leases it holds."""
    policy = GrantPolicy(slots=1, lease_steps=4)
    pis = {"a": 1.0, "b": 3.0, "c": 2.0}
    assert to_renew(pis, policy) == ["b"]
    assert to_renew(pis, GrantPolicy(slots=2)) == ["b", "c"]
    leases = renew(pis, {"a": 2, "b": 0, "c": 1}, policy, granted=["c", "gone"])
    assert leases == {"a": 2, "b": 0, "c": 4}  # a key the replica no longer has is ignored
    assert renew(pis, {"a": 2}, policy) == renew(pis, {"a": 2}, policy, granted=to_renew(pis, policy))
