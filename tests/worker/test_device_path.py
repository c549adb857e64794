"""The device path's plumbing on the CPU: the Triton attention backend (interpreted) in the
whole engine, the device arguments and their refusals, and the KV budget from a memory
profile (docs/gpu.md). What needs a GPU is in scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import AttentionConfig, DeviceConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kv_backends.paged.worker import attention_layers
from pagedllm.platforms.cuda import kv_budget_from_utilization
from pagedllm.platforms.interface import MemoryProfile
from pagedllm.worker.memory_profile import profile_forward
from tests.kernels.interpreter import import_interpreted, interpreter  # noqa: F401 (fixture)
from tests.utils import assert_greedy_match, hf_greedy

INTERPRETED = import_interpreted()
NUM_STEPS = 6


@pytest.mark.usefixtures("interpreter")
def test_triton_backend_greedy_matches_hf(tiny_llama_dir, hf_tiny_llama):
    """Decodes, first chunks and continuation chunks (max_num_batched_tokens=32 splits the
    long prompt) through the interpreted kernels: greedy equal to HF by the tie rule."""
    assert INTERPRETED
    llm = LLM(
        tiny_llama_dir, device="cpu", dtype="float32", attention_backend="triton",
        kv_cache_memory_bytes="4MiB", max_num_batched_tokens=32, max_num_seqs=4,
    )
    prompts = [list(range(100, 105)), list(range(300, 340)), [7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert attention_layers(llm.llm_engine.engine_core.runner.model)[0].backend.name == "triton"
    for prompt, out in zip(prompts, outs):
        ref, gaps = hf_greedy(hf_tiny_llama, prompt, NUM_STEPS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt of {len(prompt)}")


def test_gpu_memory_utilization_is_an_error_on_cpu():
    with pytest.raises(ValueError, match="kv-cache-memory-bytes"):
        EngineArgs(device="cpu", gpu_memory_utilization=0.5).create_engine_config()
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        DeviceConfig("cuda", 1.5)
    assert DeviceConfig("cuda").memory_utilization == 0.9


def _fake_cuda(monkeypatch, available: bool = True) -> None:
    from pagedllm.platforms.cuda import CudaPlatform

    monkeypatch.setattr(CudaPlatform, "is_available", classmethod(lambda cls: available))


def test_cuda_without_a_device_is_refused(monkeypatch):
    _fake_cuda(monkeypatch, available=False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        EngineArgs(device="cuda").create_engine_config()
    config = EngineArgs().create_engine_config()
    assert config.device_config.device == "cpu" and config.attention_config.backend == "torch"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"kv_transfer_config": '{"kv_role": "kv_producer"}'}, "KV transfer"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"quantization": "int8"}, "quantization='int8'"),
        ({"attention_backend": "torch"}, "attention_backend='torch'"),
    ],
)
def test_cuda_refusals(monkeypatch, kwargs, match):
    _fake_cuda(monkeypatch)  # checked before any CUDA call
    assert EngineArgs(device="cuda").create_engine_config().attention_config.backend == "triton"
    with pytest.raises(ValueError, match=match):
        EngineArgs(device="cuda", **kwargs).create_engine_config()


def test_vattention_refused_on_cuda_and_with_triton(monkeypatch):
    from pagedllm.kv_backends import get_kv_backend
    from pagedllm.platforms.registry import get_platform

    from pagedllm.config import CacheConfig, EngineConfig

    with pytest.raises(ValueError, match="block-table layout"):
        EngineArgs(kv_cache_backend="vattention", attention_backend="triton").create_engine_config()
    config = EngineConfig(cache_config=CacheConfig(kv_cache_backend="vattention", enable_prefix_caching=False),
                          device_config=DeviceConfig("cuda"))
    with pytest.raises(ValueError, match="not supported on device='cuda'"):
        get_kv_backend("vattention").check_config(config, get_platform("cuda"))


def test_kv_budget_from_utilization():
    profile = MemoryProfile(total_bytes=100 * 2**30, peak_bytes=12 * 2**30)
    assert kv_budget_from_utilization(profile, 0.9) == int(100 * 2**30 * 0.9) - 12 * 2**30
    with pytest.raises(ValueError, match="leaving nothing for the KV cache"):
        kv_budget_from_utilization(profile, 0.1)


def test_profile_forward_runs_and_unbinds(tiny_llama_dir):
    from pagedllm.models.loader import load_model

    loaded = load_model(tiny_llama_dir, dtype="float32", max_model_len=48)
    # 100 tokens as prompts of at most 48 (48, 48, 4): 3 + 3 + 1 blocks of 16 and the null block.
    pool = profile_forward(
        loaded.model, loaded.model_config, 100, 8, 16, AttentionConfig(), torch.device("cpu")
    )
    layers = attention_layers(loaded.model)
    assert all(layer.kv_cache is None for layer in layers)
    cfg = loaded.model_config
    assert pool == (3 + 3 + 1 + 1) * 16 * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
