"""The scheduler with a KV connector, model-free: a producer scheduler holds a finished
prompt's blocks; a consumer scheduler pulls them (the transport is simulated by copying the
fake runners' KV between block ids by hash), caches them and computes only the rest."""

from __future__ import annotations

import time

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.kv_backends.paged.kv_cache_utils import first_block_extra_keys, hash_request_tokens
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnectorScheduler
from pagedllm.request import RequestStatus
from tests.core.utils import FakeRunner, make_kv_cache_manager, make_request

BS, NUM_BLOCKS = 4, 32
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks and 2 tokens


def make(role: str, policy: str = "recompute", **config_args) -> tuple[Scheduler, FakeRunner]:
    config = KVTransferConfig(kv_role=role, kv_load_failure_policy=policy, **config_args)
    kv = make_kv_cache_manager(NUM_BLOCKS, BS)
    sched = Scheduler(
        SchedulerConfig(64, 8, 256), kv, kv_connector=ZmqConnectorScheduler(config, BS), kv_load_failure_policy=policy
    )
    return sched, FakeRunner(BS, NUM_BLOCKS)


def step(sched: Scheduler, runner: FakeRunner, kv_output: KVConnectorOutput | None = None):
    so = sched.schedule()
    out = runner.execute(so)
    out.kv_connector_output = kv_output
    return so, sched.update_from_output(so, out)


def num_used(sched: Scheduler) -> int:
    return NUM_BLOCKS - 1 - sched.kv_cache_manager.num_free_blocks


def prefill(producer: Scheduler, runner: FakeRunner) -> tuple[dict, KVConnectorMetadata]:
    producer.add_request(make_request("p", PROMPT, max_tokens=1))
    request = producer.requests["p"]
    request.kv_transfer_params = {"do_remote_decode": True}
    _, outputs = step(producer, runner)
    (out,) = outputs
    assert out.finish_reason == "length" and out.kv_transfer_params is not None
    so, _ = step(producer, runner)  # the next step carries the send to the worker side
    return out.kv_transfer_params, so.kv_connector_metadata


def test_producer_holds_full_prompt_blocks_until_sent():
    producer, runner = make("kv_producer")
    params, meta = prefill(producer, runner)
    assert params["do_remote_prefill"] and params["remote_num_blocks"] == len(PROMPT) // BS
    (send,) = meta.sends
    assert send.transfer_id == params["remote_transfer_id"]
    assert send.block_hashes == hash_request_tokens(PROMPT, BS, first_block_extra_keys(("test-model", "float32", BS), None))
    assert num_used(producer) == 4 and producer.has_pending_kv_transfers()
    step(producer, runner, KVConnectorOutput(finished_sending={send.transfer_id}))
    assert num_used(producer) == 0 and not producer.has_pending_kv_transfers()
    # The blocks stay in the prefix cache: a local request with the prompt hits them.
    _, num_hit = producer.kv_cache_manager.get_computed_blocks(make_request("again", PROMPT))
    assert num_hit == 16


def test_aborted_prefill_holds_nothing():
    producer, runner = make("kv_producer")
    producer.add_request(make_request("p", PROMPT, max_tokens=1))
    producer.requests["p"].kv_transfer_params = {"do_remote_decode": True}
    producer.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert num_used(producer) == 0 and not producer.has_pending_kv_transfers()


def transport(meta: KVConnectorMetadata, src: FakeRunner, send_meta: KVConnectorMetadata, dst: FakeRunner) -> set[str]:
    """Carry out the loads: copy the fake KV of each held block to its local block id."""
    held = {h: b for s in send_meta.sends for h, b in zip(s.block_hashes, s.block_ids)}
    for load in meta.loads:
        for block_hash, block_id in zip(load.block_hashes, load.block_ids):
            dst.kv[block_id] = list(src.kv[held[block_hash]])
    return {load.req_id for load in meta.loads}


def test_consumer_pulls_then_computes_only_the_rest():
    producer, p_runner = make("kv_producer")
    consumer, c_runner = make("kv_consumer")
    c_runner._prefix_ids = p_runner._prefix_ids  # one naming of prefixes across both "machines"
    params, send_meta = prefill(producer, p_runner)

    consumer.add_request(make_request("d", PROMPT, max_tokens=3))
    consumer.requests["d"].kv_transfer_params = params
    so, outputs = step(consumer, c_runner)
    assert so.is_empty and not outputs and "d" in consumer.waiting_for_remote
    (load,) = so.kv_connector_metadata.loads
    # At most (18 - 1) // 4 = 4 blocks: the last prompt token is computed here.
    assert len(load.block_ids) == 4 and load.block_hashes == send_meta.sends[0].block_hashes
    assert consumer.kv_cache_manager.get_computed_blocks(make_request("x", PROMPT))[1] == 0  # not cached yet
    done = transport(so.kv_connector_metadata, p_runner, send_meta, c_runner)

    step(consumer, c_runner, KVConnectorOutput(finished_recving=done))  # the pull ended
    assert consumer.waiting[0].request_id == "d" and not consumer.waiting_for_remote
    so, _ = step(consumer, c_runner)
    (new,) = so.scheduled_new_reqs  # admitted with the pulled blocks as a prefix hit
    assert new.num_computed_tokens == 16 and so.num_scheduled_tokens == {"d": 2}
    while consumer.has_unfinished_requests():
        step(consumer, c_runner)
    assert num_used(consumer) == 0
    # A second request with the same prefix hits the pulled blocks locally.
    assert consumer.kv_cache_manager.get_computed_blocks(make_request("y", PROMPT))[1] == 16


def test_nothing_to_pull_when_cached_locally_releases_the_producer():
    consumer, c_runner = make("kv_consumer")
    consumer.add_request(make_request("warm", PROMPT, max_tokens=1))
    while consumer.has_unfinished_requests():
        step(consumer, c_runner)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_transfer_id": "t", "remote_num_blocks": 4}
    consumer.add_request(make_request("d", PROMPT, max_tokens=1))
    consumer.requests["d"].kv_transfer_params = params
    so, _ = step(consumer, c_runner)
    assert so.num_scheduled_tokens == {"d": 2} and not so.kv_connector_metadata.loads
    (release,) = so.kv_connector_metadata.releases
    assert release.transfer_id == "t"


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_pull(policy):
    consumer, c_runner = make("kv_consumer", policy)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_transfer_id": "t", "remote_num_blocks": 4}
    consumer.add_request(make_request("d", PROMPT, max_tokens=2))
    consumer.requests["d"].kv_transfer_params = params
    step(consumer, c_runner)
    assert num_used(consumer) == 4
    _, outputs = step(consumer, c_runner, KVConnectorOutput(failed_recving={"d": "producer gone"}))
    if policy == "fail":
        (out,) = outputs
        assert out.finish_reason == "abort" and "producer gone" in out.error
        assert not consumer.has_unfinished_requests() and num_used(consumer) == 0
        return
    # Recompute: the whole prompt, from scratch, with nothing cached from the failed pull.
    assert not outputs and num_used(consumer) == 0
    so, _ = step(consumer, c_runner)
    assert so.num_scheduled_tokens == {"d": len(PROMPT)}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    while consumer.has_unfinished_requests():
        step(consumer, c_runner)
    assert num_used(consumer) == 0


def test_abort_while_pulling_frees_blocks_only_after_the_pull():
    consumer, c_runner = make("kv_consumer")
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_transfer_id": "t", "remote_num_blocks": 4}
    consumer.add_request(make_request("d", PROMPT, max_tokens=2))
    consumer.requests["d"].kv_transfer_params = params
    step(consumer, c_runner)
    consumer.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert num_used(consumer) == 4  # the pull may still write into them
    assert consumer.has_unfinished_requests()
    step(consumer, c_runner, KVConnectorOutput(finished_recving={"d"}))
    assert num_used(consumer) == 0 and not consumer.has_unfinished_requests()
    assert consumer.kv_cache_manager.get_computed_blocks(make_request("y", PROMPT))[1] == 0


def test_remote_wait_has_a_deadline():
    """A pull that never ends fails its request at kv_remote_wait_timeout_s (whatever the
    policy); its blocks are freed once the worker side reports the pull ended."""
    consumer, c_runner = make("kv_consumer", "recompute", kv_remote_wait_timeout_s=0.2)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_transfer_id": "t", "remote_num_blocks": 4}
    consumer.add_request(make_request("d", PROMPT, max_tokens=2))
    consumer.requests["d"].kv_transfer_params = params
    so, _ = step(consumer, c_runner)
    (load,) = so.kv_connector_metadata.loads
    assert load.deadline is not None  # the worker side gives up a little after the scheduler
    _, outputs = step(consumer, c_runner)
    assert not outputs and "d" in consumer.waiting_for_remote
    time.sleep(0.3)
    _, outputs = step(consumer, c_runner)
    (out,) = outputs
    assert out.finish_reason == "abort" and "did not arrive" in out.error and out.retryable
    assert "d" not in consumer.requests and not consumer.waiting_for_remote
    assert num_used(consumer) == 4  # the pull may still write into them
    step(consumer, c_runner, KVConnectorOutput(failed_recving={"d": "no answer"}))
    assert num_used(consumer) == 0 and not consumer.has_unfinished_requests()


def test_untrusted_params_are_not_pulled_in_the_core():
    """Params that reach the core unchecked (the offline engine) pull nothing from an
    untrusted host: the prompt is computed locally."""
    consumer, c_runner = make("kv_consumer")
    for i, params in enumerate([
        {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 14579,
         "remote_transfer_id": "t", "remote_num_blocks": 4},
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": -1,
         "remote_transfer_id": "t", "remote_num_blocks": 4},
    ]):
        consumer.add_request(make_request(f"d{i}", [t + 100 * i for t in PROMPT], max_tokens=1))
        consumer.requests[f"d{i}"].kv_transfer_params = params
        so, _ = step(consumer, c_runner)
        assert not so.kv_connector_metadata and so.num_scheduled_tokens == {f"d{i}": len(PROMPT)}
        while consumer.has_unfinished_requests():
            step(consumer, c_runner)


@pytest.mark.parametrize("limit", [{"kv_max_held_transfers": 2}, {"kv_max_held_blocks": 9}])
def test_remote_decode_holds_are_capped(limit):
    """do_remote_decode pins a prompt's blocks for kv_hold_timeout_s: at most
    kv_max_held_transfers prompts / kv_max_held_blocks blocks at once; beyond, nothing is held
    (no kv_transfer_params: the decode instance computes the prompt)."""
    producer, runner = make("kv_producer", **limit)
    answers = []
    for i in range(4):
        producer.add_request(make_request(f"p{i}", [1000 * (i + 1) + t for t in range(len(PROMPT))], max_tokens=1))
        producer.requests[f"p{i}"].kv_transfer_params = {"do_remote_decode": True}
        _, outputs = step(producer, runner)
        answers.append(outputs[0].kv_transfer_params)
    assert [a is not None for a in answers] == [True, True, False, False]
    assert num_used(producer) == 8
    held = {a["remote_transfer_id"] for a in answers if a is not None}
    step(producer, runner, KVConnectorOutput(finished_sending=held))
    assert num_used(producer) == 0
    producer.add_request(make_request("again", list(range(200, 218)), max_tokens=1))
    producer.requests["again"].kv_transfer_params = {"do_remote_decode": True}
    _, (out,) = step(producer, runner)
    assert out.kv_transfer_params is not None  # room again once the holds ended


def test_scheduler_side_imports_without_torch():
    """The connector's scheduler half lives in the torch-free control plane."""
    import subprocess
    import sys

    from tests.kv_backends.paged.test_kv_cache_utils import _SUBPROCESS_PRELUDE, REPO_ROOT

    code = _SUBPROCESS_PRELUDE + (
        "import pagedllm.distributed.kv_transfer.zmq_connector, pagedllm.distributed.kv_transfer.config\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
