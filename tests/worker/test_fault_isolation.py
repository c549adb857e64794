"""Per-request fault isolation in the runner (pagedllm/worker/fault_isolation.py): the request
whose processing raises fails alone, the others get what they get without it; a failure that
no request causes alone is raised again (the step fails, as before)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import faults
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fault_isolation import isolate, sample_isolated
from pagedllm.worker.sampling_inputs import CachedRequestState

VOCAB = 64


def _state(req_id: str, **params) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id, token_ids=[1, 2, 3], num_prompt_tokens=3,
        sampling_params=SamplingParams(**params), block_ids=[[]], num_computed_tokens=0,
    )


def test_isolate_finds_the_failing_request_and_reruns_the_others():
    calls: list[list[int]] = []

    def call(idx: list[int]) -> list[int]:
        calls.append(idx)
        if 1 in idx:
            raise ValueError("bad request")
        return [10 * i for i in idx]

    result, kept, failed = isolate(call, ["a", "b", "c"])
    assert result == [0, 20] and kept == [0, 2]
    assert failed == {"b": "ValueError: bad request"}
    assert calls == [[0, 1, 2], [0], [1], [2], [0, 2]]


def test_isolate_catches_a_request_that_fails_only_on_a_later_call():
    # "c" raises from its third call on (as an injected fault "@n" counting passes does):
    # alone in the first round it still passes, then breaks the rerun of the others. It must
    # fail alone in the next round, not fail the whole step.
    seen = {"c": 0}

    def call(idx: list[int]) -> list[int]:
        if 2 in idx:
            seen["c"] += 1
            if seen["c"] >= 3:
                raise RuntimeError("late fault")
        if 1 in idx:
            raise ValueError("bad request")
        return [10 * i for i in idx]

    result, kept, failed = isolate(call, ["a", "b", "c"])
    assert result == [0] and kept == [0]
    assert failed == {"b": "ValueError: bad request", "c": "RuntimeError: late fault"}


def test_isolate_reraises_a_failure_no_request_causes_alone():
    def call(idx: list[int]) -> None:
        if len(idx) > 1:
            raise RuntimeError("batched path broken")

    with pytest.raises(RuntimeError, match="batched path broken"):
        isolate(call, ["a", "b"])


def test_isolate_all_failing_gives_no_result():
    def call(idx: list[int]) -> None:
        raise KeyError("x")

    assert isolate(call, ["a", "b"]) == (None, [], {"a": "KeyError: 'x'", "b": "KeyError: 'x'"})


def test_sample_isolated_drops_only_the_marked_request(monkeypatch):
    monkeypatch.setattr(faults, "_FAULTS", {"sample": "poison"})
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    states = [_state("ok-1", temperature=0.0), _state("poison-2", temperature=0.0),
              _state("ok-3", temperature=0.7, seed=5, logprobs=2)]
    out, kept, failed = sample_isolated(Sampler(0), logits, states, [0])
    assert [s.req_id for s in kept] == ["ok-1", "ok-3"]
    assert list(failed) == ["poison-2"] and "injected fault at sample" in failed["poison-2"]
    # The kept requests sample as they would in a batch without the failed one.
    monkeypatch.setattr(faults, "_FAULTS", {})
    alone, _, none_failed = sample_isolated(Sampler(0), logits[[0, 2]], [states[0], states[2]], [0])
    assert not none_failed
    assert out.sampled_token_ids.tolist() == alone.sampled_token_ids.tolist()
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.logprobs is not None
