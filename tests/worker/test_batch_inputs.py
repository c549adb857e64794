"""worker/batch.py's gather_input_ids against a plain per-row reference."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.batch import gather_input_ids
from pagedllm.worker.sampling_inputs import CachedRequestState


def _state(token_ids: list[int], num_computed: int) -> CachedRequestState:
    return CachedRequestState(
        req_id=str(id(token_ids)), token_ids=token_ids, num_prompt_tokens=len(token_ids),
        sampling_params=SamplingParams(), block_ids=[[]], num_computed_tokens=num_computed,
    )


def _reference(states: list[CachedRequestState], counts: list[int], drafts: list[list[int]]) -> list[int]:
    out: list[int] = []
    for s, n, d in zip(states, counts, drafts):
        out += (s.token_ids + d)[s.num_computed_tokens : s.num_computed_tokens + n]
    return out


def _gather(states: list[CachedRequestState], counts: list[int], drafts: list[list[int]]) -> list[int]:
    c = np.asarray(counts, dtype=np.int64)
    computed = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
    query_start = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(c, out=query_start[1:])
    num_decodes = int(np.argmax(c != 1)) if (c != 1).any() else len(states)
    return gather_input_ids(states, drafts, computed, c, query_start, num_decodes).tolist()


@pytest.mark.parametrize("seed", range(20))
def test_decodes_chunks_and_drafts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_decodes, num_others = int(rng.integers(0, 6)), int(rng.integers(0, 4))
    states, counts, drafts = [], [], []
    for _ in range(num_decodes):  # one query token: the last known one
        tokens = rng.integers(0, 1000, int(rng.integers(1, 40))).tolist()
        states.append(_state(tokens, len(tokens) - 1))
        counts.append(1)
        drafts.append([])
    for _ in range(num_others):  # a prompt chunk, or a last token with k drafts
        tokens = rng.integers(0, 1000, int(rng.integers(2, 40))).tolist()
        if rng.random() < 0.5:
            done = int(rng.integers(0, len(tokens) - 1))
            states.append(_state(tokens, done))
            counts.append(int(rng.integers(2, len(tokens) - done + 1)))
            drafts.append([])
        else:
            k = int(rng.integers(1, 4))
            states.append(_state(tokens, len(tokens) - 1))
            counts.append(1 + k)
            drafts.append(rng.integers(0, 1000, k).tolist())
    assert _gather(states, counts, drafts) == _reference(states, counts, drafts)


def test_a_one_token_row_that_is_a_draft() -> None:
    # Rows of one query token are taken as known tokens only when no row among them drafts.
    states = [_state([5, 6, 7], 2), _state([8, 9], 2)]
    drafts = [[], [42]]
    assert _gather(states, [1, 1], drafts) == [7, 42] == _reference(states, [1, 1], drafts)
