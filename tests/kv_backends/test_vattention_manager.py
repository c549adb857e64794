"""VAttentionKVManager (model-free): page accounting, best-fit slot reuse, reclamation on
demand, and the scheduler preempting when pages run short, as with blocks."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.kv_backends.vattention.manager import VAttentionKVManager, vattention_layout
from pagedllm.request import RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tests.core.utils import SAMPLED_TOKEN, make_group, make_request

# 4 regions (2 layers, K and V); 64-byte tokens in 256-byte pages: 4 tokens per page.
REGIONS, TOKEN_BYTES, PAGE = 4, 64, 256


def _manager(num_pages: int = 64, num_slots: int = 4, deferred: bool = True) -> VAttentionKVManager:
    return VAttentionKVManager(
        num_pages=num_pages, page_bytes=PAGE, token_bytes=TOKEN_BYTES, num_regions=REGIONS,
        num_slots=num_slots, slot_capacity=64, max_model_len=64, deferred_reclaim=deferred,
    )


def _finish(manager: VAttentionKVManager, request) -> None:
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)


def test_pages_charged_as_tokens_grow_and_capped_at_max_model_len():
    m = _manager()
    r = make_request("a", num_prompt_tokens=5)
    assert m.allocate_slots(r, 5).block_ids == [[m.get_slot("a")]]
    assert m.resident_bytes == REGIONS * 2 * PAGE  # 5 tokens: 2 pages per region
    r.num_computed_tokens = 5
    assert m.allocate_slots(r, 3).block_ids == [[]]  # 8 tokens: still 2 pages
    assert m.resident_bytes == REGIONS * 2 * PAGE
    r.num_computed_tokens = 8
    m.allocate_slots(r, 1)
    assert m.resident_bytes == REGIONS * 3 * PAGE
    r.num_computed_tokens = 60
    m.allocate_slots(r, 100)  # capped at max_model_len = 64 tokens = 16 pages
    assert m.resident_bytes == REGIONS * 16 * PAGE
    assert m.num_free_blocks == 0 and m.usage == 1.0


def test_deferred_slot_reused_best_fit_and_released_on_demand():
    m = _manager(num_pages=48)
    big, small = make_request("big", num_prompt_tokens=32), make_request("small", num_prompt_tokens=8)
    m.allocate_slots(big, 32)  # 8 pages per region: 32 pages
    m.allocate_slots(small, 8)  # 2 per region: 8 pages
    big_slot, small_slot = m.get_slot("big"), m.get_slot("small")
    _finish(m, big)
    _finish(m, small)
    # Deferred: the pages stay resident (idle slots), but count as free; nothing to release.
    assert m.resident_bytes == 40 * PAGE and m.num_free_blocks == 48
    assert m.take_slots_to_release() == []
    # A request of 6 tokens (2 pages) takes the idle slot that fits it with least to spare.
    r = make_request("r", num_prompt_tokens=6)
    m.allocate_slots(r, 6)
    assert m.get_slot("r") == small_slot and m.resident_bytes == 40 * PAGE
    # One of 40 tokens (10 pages per region = 40 pages) fits nowhere resident: it takes the
    # slot with the most pages (big's) and needs 8 more pages, of 8 unmapped: no release.
    r2 = make_request("r2", num_prompt_tokens=40)
    m.allocate_slots(r2, 40)
    assert m.get_slot("r2") == big_slot and m.take_slots_to_release() == []
    _finish(m, r)
    # 8 more tokens for r2 (2 pages per region) need small's idle slot released.
    r2.num_computed_tokens = 40
    assert m.allocate_slots(r2, 8).block_ids == [[]]
    assert m.take_slots_to_release() == [small_slot]
    assert m.resident_bytes == REGIONS * 12 * PAGE
    # 4 more tokens cannot be had: nothing idle is left to release.
    r2.num_computed_tokens = 48
    assert m.allocate_slots(r2, 4) is None


def test_out_of_pages_returns_none_and_changes_nothing():
    m = _manager(num_pages=16)
    a = make_request("a", num_prompt_tokens=12)
    m.allocate_slots(a, 12)  # 12 pages
    before = (m.resident_bytes, m.num_free_blocks)
    b = make_request("b", num_prompt_tokens=8)
    assert m.allocate_slots(b, 8) is None  # needs 8, 4 free
    assert (m.resident_bytes, m.num_free_blocks) == before and m.get_slot("b") is None


def test_released_at_once_without_deferral():
    m = _manager(deferred=False)
    a = make_request("a", num_prompt_tokens=12)
    m.allocate_slots(a, 12)
    slot = m.get_slot("a")
    _finish(m, a)
    assert m.take_slots_to_release() == [slot] and m.resident_bytes == 0


def test_forks_refused_with_a_clear_error():
    m = _manager()
    with pytest.raises(ValueError, match="n > 1 or beam search.*kv_cache_backend='paged'"):
        m.check_request(make_group("g", 2))


def test_scheduler_preempts_when_pages_run_short():
    """Two requests growing in a budget for one: the newer is preempted and resumes later;
    every page and slot comes back."""
    m = _manager(num_pages=80, num_slots=2)  # one request of 50 tokens holds 52 pages
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64), m)
    reqs = [make_request(f"r{i}", num_prompt_tokens=20, max_tokens=30, ignore_eos=True) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    runner = _SlotRunner(num_slots=2)
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 30 for r in reqs)
    assert m.num_free_blocks == 80 and m.usage == 0.0


def test_layout_rounds_slots_to_whole_huge_pages():
    cap = vattention_layout(token_bytes=768, max_model_len=2048, align_bytes=2 << 20)
    assert cap >= 2048 and (cap * 768) % (2 << 20) == 0


class _SlotRunner:
    """A model-free runner over slots: writes each computed token id at its position in the
    request's slot and checks that every position attention reads holds the request's own
    token (a slot handed to two requests, or stale KV read from a reused slot, fails)."""

    def __init__(self, num_slots: int) -> None:
        self.kv: list[dict[int, int]] = [{} for _ in range(num_slots)]
        self.requests: dict[str, tuple[int, list[int], list[int]]] = {}  # slot, tokens, computed

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for slot in so.kv_slots_to_release:
            self.kv[slot] = {}
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            ((slot,),) = new.block_ids
            assert all(s != slot for s, _, _ in self.requests.values()), "slot already in use"
            self.requests[new.req_id] = (slot, list(new.token_ids), [new.num_computed_tokens])
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            slot, tokens, computed = self.requests[req_id]
            start, end = computed[0], computed[0] + n
            for pos in range(start, end):
                self.kv[slot][pos] = tokens[pos]
            assert [self.kv[slot].get(p) for p in range(end)] == tokens[:end], "wrong KV in slot"
            computed[0] = end
            if end == len(tokens):
                tokens.append(SAMPLED_TOKEN)
                req_ids.append(req_id)
                sampled.append([SAMPLED_TOKEN])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def test_capabilities_it_lacks_are_refused_by_name():
    """No prefix cache, forks or KV transfer: declared, and asking for them is refused with
    the backend's name (never a downcast or an AttributeError)."""
    m = _manager()
    caps = m.capabilities
    assert not (caps.prefix_caching or caps.forks or caps.delayed_caching or caps.kv_transfer)
    with pytest.raises(ValueError, match="kv_cache_backend='vattention'"):
        m.kv_transfer()
    r = make_request("a", num_prompt_tokens=5)
    with pytest.raises(ValueError, match="kv_cache_backend='vattention'.*delay_cache_blocks"):
        m.allocate_slots(r, 5, delay_cache_blocks=True)
    assert m.get_slot("a") is None  # nothing was allocated
    with pytest.raises(ValueError, match="kv_cache_backend='vattention'"):
        Scheduler(SchedulerConfig(64, 4, 64), m, kv_connector=object())  # type: ignore[arg-type]
