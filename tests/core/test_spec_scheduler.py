"""The scheduler with speculative tokens, model-free: drafts are scheduled as ordinary tokens,
rejected ones are rolled back, their KV is never cached, budgets hold, every block returns."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler

from .utils import FakeRunner, make_kv_cache_manager, make_request, output_token_ids, run_until_done


def target_token(token_ids: list[int]) -> int:
    """The 'model': a deterministic next token of the whole history."""
    return 3 + (sum(token_ids) * 31 + len(token_ids)) % 40


class SpecFakeRunner(FakeRunner):
    """FakeRunner that verifies drafts against ``target_token`` (greedy acceptance) and then
    proposes drafts: the true continuation for a random number of tokens, then wrong ones.

    KV is simulated as in FakeRunner: a draft's slot gets the id of the prefix ending in that
    draft, so a rejected draft's KV read later (not overwritten) or cached fails a check."""

    def __init__(self, block_size: int, num_blocks: int, k: int, seed: int) -> None:
        super().__init__(block_size, num_blocks)
        self.k = k
        self.rng = random.Random(seed)
        self.num_steps_with_drafts = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            assert 0 < len(drafts) <= self.k
            assert so.num_scheduled_tokens[req_id] >= len(drafts) + 1
        for new in so.scheduled_new_reqs:
            assert new.req_id not in so.scheduled_spec_decode_tokens, "new requests have no drafts"
        return self._execute_with_drafts(so)

    def _execute_with_drafts(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # FakeRunner.execute with nothing scheduled does the state updates.
        base = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        plain = SchedulerOutput(
            scheduled_new_reqs=so.scheduled_new_reqs,
            scheduled_cached_reqs=so.scheduled_cached_reqs,
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=so.finished_req_ids,
            blocks_to_copy=so.blocks_to_copy,
        )
        FakeRunner.execute(self, plain)
        proposals: list[list[int]] = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            num_known = len(state.token_ids)
            state.token_ids.extend(drafts)  # drafts get KV like any scheduled token
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            assert end <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= end, "too few blocks"
            self._write_and_check_kv(state, start, end)
            del state.token_ids[num_known:]
            del state.prefix_ids[num_known:]
            state.num_computed_tokens = end
            if end < num_known + len(drafts):
                continue
            # Verify: accept while the draft is what the target would produce.
            emitted: list[int] = []
            for draft in drafts:
                token = target_token(state.token_ids + emitted)
                emitted.append(token)
                if token != draft:
                    break
            else:
                emitted.append(target_token(state.token_ids + emitted))
            state.token_ids.extend(emitted)
            state.num_computed_tokens = len(state.token_ids) - 1
            self.num_steps_with_drafts += bool(drafts)
            base.req_ids.append(req_id)
            base.sampled_token_ids.append(emitted)
            proposals.append(self._propose(state.token_ids))
        base.spec_token_ids = proposals
        return base

    def _propose(self, token_ids: list[int]) -> list[int]:
        num_right = self.rng.randrange(0, self.k + 1)
        drafts: list[int] = []
        for i in range(self.k):
            token = target_token(token_ids + drafts)
            drafts.append(token if i < num_right else 44 + (token % 3))  # 44.. is never a target
        return drafts


def make_spec_scheduler(k: int, budget: int, num_blocks: int, max_model_len: int = 96) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=max_model_len)
    kv = make_kv_cache_manager(num_blocks, 4, max_model_len)
    return Scheduler(config, kv, speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=k))


def reference_outputs(prompts: dict[str, list[int]], max_tokens: dict[str, int], max_model_len: int):
    out = {}
    for req_id, prompt in prompts.items():
        tokens = list(prompt)
        n = min(max_tokens[req_id], max_model_len - len(prompt))
        for _ in range(n):
            tokens.append(target_token(tokens))
        out[req_id] = tokens[len(prompt):]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_spec_tokens_roll_back_and_outputs_match_non_speculative(seed: int) -> None:
    rng = random.Random(seed)
    k, budget, max_model_len = 3, 12, 96
    scheduler = make_spec_scheduler(k, budget, num_blocks=40, max_model_len=max_model_len)
    runner = SpecFakeRunner(4, 40, k, seed)
    shared = [rng.randrange(3, 40) for _ in range(9)]
    prompts, max_tokens = {}, {}
    for i in range(16):  # shared prefixes: prefix hits would expose a wrongly cached block
        prompt = shared + [rng.randrange(3, 40) for _ in range(rng.randrange(1, 12))]
        prompts[f"r{i}"] = prompt
        max_tokens[f"r{i}"] = rng.randrange(1, 40)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens[f"r{i}"], ignore_eos=True))
    kv = scheduler.kv_cache_manager

    def check(so: SchedulerOutput, _outs) -> None:
        assert so.total_num_scheduled_tokens <= budget  # drafts count against the budget
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            assert so.num_scheduled_tokens[req_id] == len(drafts) + 1
        for request in scheduler.running:
            # Only accepted tokens may be hashed: cached blocks lie within num_tokens.
            req_blocks = kv._requests[request.request_id]
            assert req_blocks.num_cached_blocks * 4 <= request.num_tokens
            assert request.num_computed_tokens <= request.num_tokens

    outputs = run_until_done(scheduler, runner, on_step=check)
    expected = reference_outputs(prompts, max_tokens, max_model_len)
    for req_id, want in expected.items():
        assert output_token_ids(outputs[req_id]) == want, req_id
    assert runner.num_steps_with_drafts > 20
    stats = scheduler.get_stats().spec_decoding_stats
    assert stats is not None and stats.num_drafts == runner.num_steps_with_drafts
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv._requests == {}


def test_drafts_are_trimmed_to_the_budget_and_preemption_drops_them() -> None:
    scheduler = make_spec_scheduler(k=4, budget=6, num_blocks=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", list(range(10 + i, 14 + i)), max_tokens=8, ignore_eos=True))
    so = scheduler.schedule()  # three prompts of 4 tokens: 6 fit (one chunk of 2)
    assert so.total_num_scheduled_tokens == 6
    # r0 finished its prompt: give it drafts, as a runner would.
    out = ModelRunnerOutput(req_ids=["r0"], sampled_token_ids=[[5]], spec_token_ids=[[6, 7, 8, 9]])
    scheduler.update_from_output(so, out)
    assert scheduler.requests["r0"].spec_token_ids == [6, 7, 8, 9]
    so = scheduler.schedule()
    # r0 decodes first with drafts filling the budget: 1 + 4 tokens, then one token of r1.
    assert so.num_scheduled_tokens["r0"] == 5 and so.scheduled_spec_decode_tokens["r0"] == [6, 7, 8, 9]
    assert so.total_num_scheduled_tokens == 6
    # Two drafts accepted, plus the corrected token: num_computed rolls back by two.
    before = scheduler.requests["r0"].num_computed_tokens
    out = ModelRunnerOutput(req_ids=["r0"], sampled_token_ids=[[6, 7, 11]], spec_token_ids=[[1, 2, 3, 4]])
    scheduler.update_from_output(so, out)
    r0 = scheduler.requests["r0"]
    assert r0.num_computed_tokens == before - 2 == r0.num_tokens - 1
    assert r0.output_token_ids == [5, 6, 7, 11]
    # A budget of 6 with r1 and r2 still prefilling: r0's drafts shrink to what fits.
    scheduler.max_num_batched_tokens = 3
    so = scheduler.schedule()
    assert so.num_scheduled_tokens["r0"] == 3 and so.scheduled_spec_decode_tokens["r0"] == [1, 2]
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    assert r0.num_computed_tokens == r0.num_tokens + 2  # not verified yet (no output)
    scheduler._preempt(r0)
    scheduler.running.remove(r0)
    assert r0.spec_token_ids == [] and r0.num_computed_tokens == 0
    for request_id in list(scheduler.requests):
        scheduler.finish_requests(request_id, r0.status.FINISHED_ABORTED)
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_blocks_holding_rejected_drafts_are_never_hashed() -> None:
    scheduler = make_spec_scheduler(k=4, budget=32, num_blocks=32)
    kv = scheduler.kv_cache_manager
    # 6 prompt tokens; block size 4.
    scheduler.add_request(make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=16, ignore_eos=True))
    so = scheduler.schedule()
    scheduler.update_from_output(so, ModelRunnerOutput(["a"], [[20]], spec_token_ids=[[21, 22, 23, 24]]))
    so = scheduler.schedule()  # positions 6..10: block 1 (4..7) and block 2 (8..11) get drafts
    request = scheduler.requests["a"]
    blocks = kv._requests["a"].blocks[0]
    assert [b.block_hash is not None for b in blocks] == [True, False, False]
    # All four drafts rejected: one corrected token.
    scheduler.update_from_output(so, ModelRunnerOutput(["a"], [[30]], spec_token_ids=[[31]]))
    assert request.num_computed_tokens == 7 and request.all_token_ids[6:] == [20, 30]
    so = scheduler.schedule()  # block 1 now holds accepted tokens only: hashed over them
    assert blocks[1].block_hash is not None and blocks[2].block_hash is None
    hashes = kv._get_block_hashes(request)
    assert blocks[1].block_hash == hashes[1]
    scheduler.finish_requests("a", request.status.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_blocks - 1
