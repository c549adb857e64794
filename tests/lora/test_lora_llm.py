"""LoRA adapters through the offline LLM: greedy equal to HF + PEFT with the adapter merged
(DESIGN.md's tie rule, float32), adapters of different ranks and the base in one generate
call, on a float base and on a quantized (Q4_1 GGUF) one; prefix-cache isolation; refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.lora.utils import save_random_adapter, save_tiny_llama
from tests.models.utils import save_tiny_gguf
from tests.utils import assert_greedy_match, hf_greedy

PROMPTS = ["Hello, my name is", "The quick brown fox", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes="16MiB", max_model_len=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base, two adapters (rank 8 on every projection; rank 4 rsLoRA on q, v and down
    only) and their merged HF references."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base")
    merged_a = save_random_adapter(base, root / "a", seed=1, r=8)
    merged_b = save_random_adapter(base, root / "b", seed=2, r=4, targets=("q_proj", "v_proj", "down_proj"),
                                   use_rslora=True)
    return {"root": root, "base": base, "a": merged_a, "b": merged_b}


def lora(checkpoints: dict[str, Any], name: str) -> LoRARequest:
    return LoRARequest(name, {"a": 1, "b": 2}[name], str(checkpoints["root"] / name))


def fused_steps_with_adapters(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the decode steps the compiled forward runs while adapters are active."""
    from pagedllm.lora.layers import active_mapping
    from pagedllm.models.fused_decode import FusedDecoderLayers

    counts: list[int] = []
    forward = FusedDecoderLayers.forward

    def spy(self, positions, hidden_states):
        mapping = active_mapping()
        if mapping is not None and bool((mapping.row_slots >= 0).any()):
            counts.append(hidden_states.shape[0])
        return forward(self, positions, hidden_states)

    monkeypatch.setattr(FusedDecoderLayers, "forward", spy)
    return counts


def check_mixed_batch(llm: LLM, checkpoints: dict[str, Any], refs: dict[str | None, Any],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt under a, b and the base, interleaved in one generate call; the decode
    steps run the compiled forward with the adapters' deltas (kernels/csrc/lora_delta.h),
    whatever form the base's weights are kept in."""
    names = [None, "a", "b"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else lora(checkpoints, n) for _ in PROMPTS for n in names]
    fused = fused_steps_with_adapters(monkeypatch)
    outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert len(fused) >= MAX_TOKENS - 1, "the decode steps with adapters did not run fused"
    distinct = set()
    for out, request in zip(outs, loras):
        name = None if request is None else request.lora_name
        ref, gaps = hf_greedy(refs[name], out.prompt_token_ids, MAX_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{out.prompt!r} under {name}")
        distinct.add((out.prompt, tuple(out.outputs[0].token_ids)))
    assert len(distinct) > len(PROMPTS), "the adapters change nothing: the test could not fail"


def test_mixed_adapters_match_hf_peft_merged(checkpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(checkpoints["root"] / "base"), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    refs = {None: checkpoints["base"], "a": checkpoints["a"], "b": checkpoints["b"]}
    check_mixed_batch(llm, checkpoints, refs, monkeypatch)
    # The module path (layers/linear.py's hook, lora/layers.py's stacked form) alike.
    llm.llm_engine.engine_core.runner.model.model.fused_layers.enabled = False
    names = [None, "a", "b"]
    loras = [None if n is None else lora(checkpoints, n) for n in names]
    outs = llm.generate(PROMPTS[:1] * 3, GREEDY, lora_request=loras, use_tqdm=False)
    for out, name in zip(outs, names):
        ref, gaps = hf_greedy(refs[name], out.prompt_token_ids, MAX_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"module path under {name}")
    # Same prompt under a, b and the base: no prefix-cache hit across adapters; under one
    # adapter the second request hits.
    prompt = {"prompt_token_ids": list(range(40, 40 + 40))}  # two full 16-token blocks and more
    one = SamplingParams(temperature=0, max_tokens=1)
    for request in (None, lora(checkpoints, "a"), lora(checkpoints, "b")):
        first = llm.generate([prompt], one, lora_request=request, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0, f"{request}: a hit on KV computed under another adapter"
    again = llm.generate([prompt], one, lora_request=lora(checkpoints, "a"), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0"])
def test_quantized_base_matches_hf_peft_on_the_dequantized_weights(
    checkpoints: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str
) -> None:
    """A Q4_1 (QuantizedWeight) or Q5_0 (GGUF blocks) base, kept quantized (the delta is added
    to the quantized projections' output), against HF reading the same file with each adapter
    merged into it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    root = checkpoints["root"]
    path = root / "base" / f"tiny-{qtype}.gguf"
    save_tiny_gguf(path, checkpoints["base"], AutoTokenizer.from_pretrained(root / "base"), qtype)

    def reference(adapter: str | None) -> Any:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(root / adapter)).merge_and_unload()
        return model.eval()

    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, quantization="gguf", **ENGINE)
    layer = llm.llm_engine.engine_core.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.kept_weights() and layer.mlp.down_proj.kept_weights()
    assert (layer.self_attn.qkv_proj.blocks is not None) == (qtype == "Q5_0")
    refs = {n: reference(n) for n in (None, "a", "b")}
    check_mixed_batch(llm, checkpoints, refs, monkeypatch)


def test_a_request_waiting_for_a_slot_holds_no_one_behind(checkpoints: dict[str, Any]) -> None:
    """max_loras=1: a, b, a, base queued together; every step has at most one adapter, and
    all finish with the results they have alone."""
    llm = LLM(str(checkpoints["root"] / "base"), enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    runner = llm.llm_engine.engine_core.runner
    seen: list[set[int]] = []
    prepare = runner.lora_manager.prepare

    def spy(requests, counts):
        seen.append({r.lora_int_id for r in requests if r is not None})
        return prepare(requests, counts)

    runner.lora_manager.prepare = spy
    loras = [lora(checkpoints, "a"), lora(checkpoints, "b"), lora(checkpoints, "a"), None]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    assert max(len(s) for s in seen) == 1
    assert {2} in seen and {1} in seen
    refs = {None: checkpoints["base"], "a": checkpoints["a"], "b": checkpoints["b"]}
    for out, request in zip(outs, loras):
        ref, gaps = hf_greedy(refs[None if request is None else request.lora_name], out.prompt_token_ids, MAX_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps)


def _adapter_with(tmp_path: Path, checkpoints: dict[str, Any], **changes: Any) -> LoRARequest:
    """Adapter a's files with its config changed."""
    target = tmp_path / "changed"
    target.mkdir(exist_ok=True)
    source = checkpoints["root"] / "a"
    (target / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    config = json.loads((source / "adapter_config.json").read_text())
    config.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest("changed", 9, str(target))


def test_refusals(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    root = checkpoints["root"]
    plain = LLM(str(root / "base"), **ENGINE)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=lora(checkpoints, "a"), use_tqdm=False)
    llm = LLM(str(root / "base"), enable_lora=True, max_lora_rank=4, **ENGINE)
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=lora(checkpoints, "a"), use_tqdm=False)
    llm = LLM(str(root / "base"), enable_lora=True, max_lora_rank=8, **ENGINE)
    cases = {
        "DoRA": dict(use_dora=True),
        "modules_to_save": dict(modules_to_save=["lm_head"]),
        "embeddings or the LM head": dict(target_modules=["q_proj", "embed_tokens"]),
    }
    for match, changes in cases.items():
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=_adapter_with(tmp_path, checkpoints, **changes),
                         use_tqdm=False)
    # A base of another shape: an adapter trained on a wider model.
    other = save_tiny_llama(tmp_path / "wide", hidden_size=96)
    save_random_adapter(other, tmp_path / "wide-lora", seed=3, r=4)
    with pytest.raises(ValueError, match="an adapter of another base"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("wide", 5, str(tmp_path / "wide-lora")),
                     use_tqdm=False)
    # An lm_head tensor in the weights file.
    bad = tmp_path / "head"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(262, 8)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adaptable projection"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("head", 6, str(bad)), use_tqdm=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(str(root / "base"), enable_lora=True, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "")
    # The engine still serves after every refusal.
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_speculative_decoding_with_adapters_is_lossless(checkpoints: dict[str, Any]) -> None:
    """ngram drafts verified under each request's adapter: greedy equal to HF + PEFT merged."""
    llm = LLM(str(checkpoints["root"] / "base"), enable_lora=True, max_loras=2, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    prompts = ["1, 2, 3, 1, 2, 3, 1, 2, 3,", "abc abc abc abc"] * 2
    loras = [lora(checkpoints, "a"), lora(checkpoints, "b"), None, lora(checkpoints, "a")]
    refs = {None: checkpoints["base"], "a": checkpoints["a"], "b": checkpoints["b"]}
    outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    for out, request in zip(outs, loras):
        name = None if request is None else request.lora_name
        ref, gaps = hf_greedy(refs[name], out.prompt_token_ids, MAX_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"speculative, under {name}")
