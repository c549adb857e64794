"""The scheduler's LoRA rules, model-free: at most max_loras distinct adapters run at once, a
request waiting for a slot holds no one behind it, and the prefix cache keys by adapter."""

from __future__ import annotations

from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from tests.core.utils import FakeRunner, make_kv_cache_manager, make_request, run_until_done

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def make_lora_scheduler(max_loras: int) -> Scheduler:
    from pagedllm.config import SchedulerConfig

    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
                     make_kv_cache_manager(), max_loras=max_loras)


def with_lora(request_id: str, lora: LoRARequest | None, **kwargs):
    request = make_request(request_id, **kwargs)
    request.lora_request = lora
    return request


def test_waiting_for_a_slot_holds_no_one_behind() -> None:
    scheduler = make_lora_scheduler(max_loras=2)
    loras = {"a": A, "b": B, "c": C, "base": None, "a2": A}
    for request_id, lora in loras.items():
        scheduler.add_request(with_lora(request_id, lora))
    first = scheduler.schedule()
    # c waits (a and b hold both slots); the base request and a2 (a's adapter) behind it run.
    assert set(first.num_scheduled_tokens) == {"a", "b", "base", "a2"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert {r.req_id: r.lora_request for r in first.scheduled_new_reqs}["b"] == B
    active: list[set[int]] = []

    def on_step(so, _) -> None:
        active.append({loras[r].lora_int_id for r in so.num_scheduled_tokens if loras[r] is not None})

    runner = FakeRunner(4, 64)
    scheduler.update_from_output(first, runner.execute(first))
    outputs = run_until_done(scheduler, runner, on_step=on_step)
    assert outputs["c"][-1].finish_reason == "length"
    assert max(len(ids) for ids in active) <= 2 and {3} in [ids & {3} for ids in active]


def test_prefix_cache_keys_by_adapter() -> None:
    prompt = list(range(100, 116))  # four full blocks of 4
    scheduler = make_lora_scheduler(max_loras=2)
    kv = scheduler.kv_cache_manager
    hashes = {}
    for request_id, lora in [("base", None), ("a", A), ("b", B), ("a-again", A)]:
        hashes[request_id] = kv._get_block_hashes(with_lora(request_id, lora, prompt_token_ids=prompt))
    assert len({tuple(h) for h in hashes.values()}) == 3
    assert hashes["a"] == hashes["a-again"]
    assert not set(hashes["a"]) & set(hashes["b"]) and not set(hashes["a"]) & set(hashes["base"])
