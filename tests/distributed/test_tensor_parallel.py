"""Tensor parallelism: greedy outputs of 2 ranks equal to 1 rank (mp and ray executors),
the clear refusal of head counts that do not divide, and a killed worker failing the engine."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.executor import ExecutorFailedError, WorkerDiedError
from tests.entrypoints.utils import RemoteServer, child_pids, engine_core_pid, pid_alive
from tests.utils import TEXT_PROMPTS, assert_same_greedy, tokens_and_gaps

NUM_STEPS = 12
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes="16MiB", max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory, default_tokenizer):
    """A tiny random GPT-2, 4 heads, with an odd vocabulary (one more row than the tokenizer)
    so the vocabulary-parallel table of the last rank is padded."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2")
    config = GPT2Config(
        vocab_size=len(default_tokenizer) + 1, n_embd=64, n_layer=2, n_head=4, n_positions=512,
        initializer_range=0.2, bos_token_id=default_tokenizer.bos_token_id,
        eos_token_id=default_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    default_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, tiny_gpt2_dir):
    return {"llama": tiny_llama_dir, "gpt2": tiny_gpt2_dir}


def greedy_with_gaps(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and top-2 gaps of each prompt; the last entry is a seeded sampled
    request (temperature 1): every rank must draw the same tokens to stay in step."""
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=NUM_STEPS, temperature=1.0, ignore_eos=True, seed=1234, logprobs=2)
    outs = llm.generate(TEXT_PROMPTS + TEXT_PROMPTS[:1], [params] * len(TEXT_PROMPTS) + [sampled], use_tqdm=False)
    return tokens_and_gaps(outs)


@pytest.fixture(scope="module")
def single_rank(checkpoints):
    """Greedy tokens and gaps of each checkpoint with one rank (the reference)."""
    results = {}
    for name, path in checkpoints.items():
        llm = LLM(path, **ENGINE_ARGS)
        results[name] = greedy_with_gaps(llm)
    return results


def check_tp2(llm: LLM, reference: tuple[list[list[int]], list[list[float]]], label: str) -> None:
    tokens, _ = greedy_with_gaps(llm)
    ref_tokens, ref_gaps = reference
    for i, (ours, ref, gaps) in enumerate(zip(tokens[:-1], ref_tokens, ref_gaps)):
        assert len(ours) == NUM_STEPS
        assert_same_greedy(ours, ref, gaps, f"{label} prompt {i}")
    # Seeded sampling: the same draws from (within float rounding) the same distributions.
    assert tokens[-1] == ref_tokens[-1], f"{label}: seeded sample {tokens[-1]} != {ref_tokens[-1]}"
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == llm.llm_engine.config.num_blocks - 1  # every block came back


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.engine_core.runner.procs.values()]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp2_mp_matches_tp1(name, checkpoints, single_rank):
    """GPT-2 then shuts down cleanly; Llama's worker is then killed, which fails the engine."""
    affinity = os.sched_getaffinity(0)
    llm = LLM(checkpoints[name], tensor_parallel_size=2, **ENGINE_ARGS)
    pids = worker_pids(llm)
    try:
        # Each rank holds half the KV heads of every layer.
        layer = llm.llm_engine.engine_core.runner.runner.kv_caches[0]
        assert layer.shape[-2] == (2 if name == "llama" else 4) // 2
        check_tp2(llm, single_rank[name], f"{name} tp=2 mp")
        if name == "llama":
            check_killed_worker(llm, pids[0])
    finally:
        llm.shutdown()
    assert_gone(pids)
    assert os.sched_getaffinity(0) == affinity  # rank 0's pinning undone


def check_killed_worker(llm: LLM, pid: int) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        llm.generate(TEXT_PROMPTS[:2], params, use_tqdm=False)
    with pytest.raises(ExecutorFailedError, match="shut down"):
        llm.generate(TEXT_PROMPTS[:1], params, use_tqdm=False)


def test_default_model_heads_do_not_divide():
    with pytest.raises(ValueError, match=r"9 query heads and 3 KV heads .*\[1, 3\]"):
        LLM("SmolLM2-135M-Instruct", tensor_parallel_size=2, dtype="float32", quantization="none")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"quantization": "int8"}, "does not shard quantized weights"),
        ({"kv_cache_backend": "vattention"}, "does not support kv_cache_backend='vattention'"),
        ({"distributed_executor_backend": "uni"}, "'uni' runs one rank in process"),
    ],
)
def test_refusals(tiny_llama_dir, extra, message):
    args = {**ENGINE_ARGS, "tensor_parallel_size": 2, **extra}
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama_dir, **args)


def test_cpu_bind_spec():
    from pagedllm.distributed.cpu_bind import rank_cpus

    assert rank_cpus(1, 2, "0-3|4-5,7") == [4, 5, 7]
    assert rank_cpus(0, 2, "all") is None
    assert [rank_cpus(r, 2, "", available=[0, 1, 2, 3, 4]) for r in range(2)] == [[0, 1], [2, 3]]
    assert rank_cpus(0, 4, "", available=[0, 1]) is None  # fewer cores than ranks: no pinning
    with pytest.raises(ValueError, match="lists 1 core sets for tensor_parallel_size=2"):
        rank_cpus(0, 2, "0-3")


@pytest.mark.slow
def test_server_worker_killed_gives_503_and_exit(tiny_llama_dir):
    """`pagedllm serve --tensor-parallel-size 2`: serves; a killed worker makes the engine core
    exit with the reason logged, the server answer 503 and exit 1, no process left behind."""
    srv = RemoteServer(
        ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB",
         "--max-num-seqs", "8", "--tensor-parallel-size", "2"],
        model=tiny_llama_dir, startup_timeout_s=600,
    )
    try:
        core = engine_core_pid(srv.proc.pid)
        workers = [p for p in child_pids(core) if b"worker_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(workers) == 1, workers
        body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        url = srv.url + "/v1/completions"
        assert httpx.post(url, json=body, timeout=120).status_code == 200
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 503, r.text
        assert srv.proc.wait(60) == 1, srv.log()
        assert f"rank 1 (pid {workers[0]}) was killed by SIGKILL" in srv.log()
        assert not pid_alive(core) and not pid_alive(workers[0])
    finally:
        srv.stop()


@pytest.fixture
def local_ray_cluster(monkeypatch):
    """`ray start --head` on loopback with 2 CPUs (DESIGN.md: Ray binds 127.0.0.1 only with
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), stopped at the end."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from pagedllm.distributed.mp_executor import _free_port

    ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must fit 107 bytes
    subprocess.run(
        [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats",
         "--temp-dir", temp_dir],
        env=env, check=True, capture_output=True, timeout=120,
    )
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    try:
        yield
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_tp2_ray_matches_tp1(local_ray_cluster, checkpoints, single_rank):
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
    try:
        check_tp2(llm, single_rank["llama"], "llama tp=2 ray")
    finally:
        llm.shutdown()
