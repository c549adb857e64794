"""Session fixtures: one loaded engine per configuration, shared across tests."""

from __future__ import annotations

import os

import pytest

# Tests see two cores at most; keep torch from oversubscribing when pytest runs in parallel.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test touches the network: a hub id resolves from the hub cache alone (models/hub.py).
os.environ["HF_HUB_OFFLINE"] = "1"
# Tests that point PAGEDLLM_CACHE_DIR at a temporary directory (GGUF conversions) must not
# send the compiled kernels there too: one build per session, not one per such test.
from pagedllm.kernels import kernel_cache_root  # noqa: E402

os.environ.setdefault("PAGEDLLM_KERNEL_CACHE_DIR", kernel_cache_root())

from pagedllm.platforms.cpu import CpuPlatform  # noqa: E402

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PLATFORM_MATMUL_ACTIVATIONS = CpuPlatform.auto_matmul_activations


@pytest.fixture(scope="session", autouse=True)
def float32_matmul_activations():
    """`--matmul-activations auto` resolves to float32 in tests (servers: RemoteServer passes
    float32): they compare greedy sequences by DESIGN.md's tie rule, which is for float32
    activations. The fast modes are tested against float32 with their own bounds
    (tests/models/test_bf16_activations.py); `platform_matmul_activations` undoes this."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuPlatform, "auto_matmul_activations", lambda self, config: "float32")
        yield


@pytest.fixture(autouse=True)
def fresh_weight_caches():
    """zentorch (AMD CPUs) caches packed weights by address (kernels/linear.py): a test's
    module whose weight lands where an earlier test's freed weight was would be served that
    stale copy. Engines write weights through loaders, which clear it; tests that build
    modules by hand start from an empty cache."""
    from pagedllm.kernels.linear import clear_weight_caches

    clear_weight_caches()
    yield


@pytest.fixture
def platform_matmul_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, "auto" is the platform's choice again (platforms/cpu.py)."""
    monkeypatch.setattr(CpuPlatform, "auto_matmul_activations", _PLATFORM_MATMUL_ACTIVATIONS)


def pytest_configure(config: pytest.Config) -> None:
    # Triton decides at its first import whether its kernels run interpreted, and other
    # imports bring it in (transformers' model classes do): import it first, interpreted, so
    # the Triton tests on CPU tensors run whatever the order of collection
    # (tests/kernels/interpreter.py; 0.2 s). PAGEDLLM_TEST_DEVICE=cuda compiles them instead.
    if os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu") == "cpu":
        from tests.kernels.interpreter import import_interpreted

        import_interpreted()


@pytest.fixture(scope="session")
def default_loaded():
    """Our loader's view of the real default model (GGUF), float32. (A full load, 10-20 s:
    the default engine, `default_llm`, or a module's own load may serve instead.)"""
    from pagedllm.models.loader import load_model

    return load_model(DEFAULT_MODEL, dtype="float32", max_model_len=2048)


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer, as our loader builds it, without loading the weights."""
    from pagedllm.models.gguf_loader import gguf_to_hf_dir
    from pagedllm.models.loader import _load_tokenizer, resolve_checkpoint

    gguf_path, model_dir = resolve_checkpoint(DEFAULT_MODEL)
    return _load_tokenizer(gguf_to_hf_dir(gguf_path) if gguf_path else model_dir)


@pytest.fixture(scope="session")
def hf_default_model():
    """HF transformers loading the same GGUF file: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.models.loader import resolve_checkpoint

    path, _ = resolve_checkpoint(DEFAULT_MODEL)
    assert path is not None
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def default_llm():
    from pagedllm import LLM

    return LLM(DEFAULT_MODEL, dtype="float32", matmul_activations="float32", max_model_len=2048,
               kv_cache_memory_bytes="256MiB")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_tokenizer):
    """A tiny random-weight Llama saved as safetensors with the default model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(default_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # peaky logits: few near-ties in greedy comparisons
        tie_word_embeddings=False,
        bos_token_id=default_tokenizer.bos_token_id,
        eos_token_id=default_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    default_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def think_model_dir(tmp_path_factory, default_tokenizer):
    """A tiny Llama that writes "hello world</think>" over and over (tests/reasoning/think_model.py)."""
    from tests.reasoning.think_model import save_think_model

    path = tmp_path_factory.mktemp("think-model")
    save_think_model(path, default_tokenizer)
    return str(path)
