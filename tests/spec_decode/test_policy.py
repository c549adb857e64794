"""The draft policy (spec_decode/policy.py): which requests get drafts, model-free."""

from __future__ import annotations

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.policy import DraftPolicy


def _policy(**keys: object) -> DraftPolicy:
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **keys})
    assert config is not None
    return DraftPolicy(config)


def test_without_rules_every_request_is_drafted_for() -> None:
    policy = _policy()
    policy.observe(["a", "b"], [[1, 2, 3, 4], [5]], [[9], [6]])  # nothing accepted
    assert policy.proposing(["a", "b"], 200) == [0, 1]


def test_disable_by_batch_size_turns_drafts_off_for_the_step() -> None:
    policy = _policy(disable_by_batch_size=4)
    assert policy.proposing(["a", "b", "c"], 3) == [0, 1, 2]
    # The step ran 4 requests (one of them a prompt chunk that did not sample): none drafted.
    assert policy.proposing(["a", "b", "c"], 4) == []
    assert policy.proposing(["a"], 1) == [0]


def test_poor_acceptance_waits_with_a_doubling_backoff() -> None:
    policy = _policy(min_acceptance_rate=0.3)
    ids = ["good", "poor"]
    waits = []
    for _ in range(40):
        chosen = policy.proposing(ids, 2)
        assert 0 in chosen  # all of its drafts accepted: always drafted for
        drafts = [[1, 2, 3, 4], [1, 2, 3, 4] if 1 in chosen else []]
        policy.observe(ids, drafts, [[1, 2, 3, 4, 5], [7]])
        waits.append(1 in chosen)
    # The poor request: drafted for at steps 0, 1 (the average falls below 0.3 after two
    # misses), then after waits of 1, 2, 4, 8, 16 steps (capped at 32 later).
    assert [i for i, drafted in enumerate(waits) if drafted] == [0, 1, 3, 6, 11, 20, 37]
    # A finished request's record goes with it.
    policy.forget(["poor"])
    assert policy.proposing(ids, 2) == [0, 1]


def test_acceptance_recovers_when_drafts_are_accepted_again() -> None:
    policy = _policy(min_acceptance_rate=0.5)
    policy.observe(["r"], [[1, 2]], [[1, 2, 3]])
    policy.observe(["r"], [[1, 2]], [[1, 4]])  # 1 of 2: average 0.75
    assert policy.proposing(["r"], 1) == [0]
    policy.observe(["r"], [[1, 2]], [[5]])  # 0 of 2: 0.375 < 0.5, wait 1 step
    assert policy.proposing(["r"], 1) == []
    assert policy.proposing(["r"], 1) == [0]


@pytest.mark.parametrize(
    ("keys", "message"),
    [({"disable_by_batch_size": 0}, "disable_by_batch_size"), ({"min_acceptance_rate": 1.5}, "min_acceptance_rate")],
)
def test_bad_policy_keys_are_refused(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **keys})
