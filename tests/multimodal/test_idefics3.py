"""Idefics3 / SmolVLM end to end on a tiny random checkpoint: greedy equal to HF transformers
(DESIGN.md's tie rule, float32) with one, two and no images, batched with text-only requests,
through chunked prefill that splits an image, and through the prefix and encoder caches."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal.conftest import random_image
from tests.utils import assert_greedy_match

MAX_TOKENS = 8
PREAMBLE = "A shared preamble that fills the first blocks of every prompt here. "
PROMPTS = [  # (text, number of images)
    (PREAMBLE + "Describe <image> briefly.", 1),
    (PREAMBLE + "Compare <image> with <image> now.", 2),
    (PREAMBLE + "No image here, just words.", 0),
]


def _engine(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", matmul_activations="float32", max_model_len=512,
               kv_cache_memory_bytes="16MiB", block_size=8, **kwargs)


@pytest.fixture(scope="module")
def vlm(tiny_idefics3_dir):
    return _engine(tiny_idefics3_dir)


def _inputs(seed: int = 0) -> list[dict]:
    prompts, image_seed = [], seed
    for text, n in PROMPTS:
        images = [random_image(image_seed + i, 48 + 8 * i, 40) for i in range(n)]
        image_seed += n
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if n else {"prompt": text})
    return prompts


def hf_greedy_mm(hf, prompt: dict) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and top-2 logprob gaps for a prompt with images (its processor
    expands the placeholders and preprocesses the pixels)."""
    return _hf_greedy_n(hf, prompt, MAX_TOKENS)


def _hf_greedy_n(hf, prompt: dict, max_tokens: int) -> tuple[list[int], list[float]]:
    model, processor = hf
    images = prompt.get("multi_modal_data", {}).get("image")
    if images:
        inputs = processor(text=[prompt["prompt"]], images=[images], return_tensors="pt")
    else:
        inputs = processor(text=[prompt["prompt"]], return_tensors="pt")
    tokens, gaps = [], []
    with torch.inference_mode():
        out = model(**inputs, use_cache=True)
        for _ in range(max_tokens):
            top2 = torch.log_softmax(out.logits[0, -1].float(), dim=-1).topk(2)
            tokens.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, gaps


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_matches_hf_batched_with_text_only(vlm, hf_tiny_idefics3, default_tokenizer):
    prompts = _inputs()
    # A plain text request of the default tokenizer's words rides in the same batch.
    outs = vlm.generate([*prompts, "Hello, my name is"], _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, gaps = hf_greedy_mm(hf_tiny_idefics3, prompt)
        assert_greedy_match(list(out.outputs[0].token_ids), ref, gaps, prompt["prompt"])
    ref, gaps = hf_greedy_mm(hf_tiny_idefics3, {"prompt": "Hello, my name is"})
    assert_greedy_match(list(outs[-1].outputs[0].token_ids), ref, gaps, "text only")


def test_chunked_prefill_splits_an_image(tiny_idefics3_dir, hf_tiny_idefics3):
    """Chunks of 6 tokens: an image's 4 placeholders straddle a chunk boundary; each chunk
    takes its own rows of the image's (once-encoded) embeddings."""
    llm = _engine(tiny_idefics3_dir, max_num_batched_tokens=6, max_num_seqs=2, enable_prefix_caching=False)
    prompts = _inputs(seed=10)
    processor = llm.llm_engine.input_processor.images
    split = False
    for p in prompts[:2]:
        _, features = processor.process(p["prompt"], p["multi_modal_data"]["image"])
        split |= any(f.offset // 6 != (f.end - 1) // 6 for f in features)
    assert split, "no image crosses a chunk boundary: the test does not exercise the split"
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, gaps = hf_greedy_mm(hf_tiny_idefics3, prompt)
        assert_greedy_match(list(out.outputs[0].token_ids), ref, gaps, prompt["prompt"])


def test_prefix_cache_keys_on_the_image(vlm):
    text = PREAMBLE + "Describe <image> briefly."
    first, second = random_image(100), random_image(101)
    _, (feature,) = vlm.llm_engine.input_processor.images.process(text, [first])
    text_blocks = feature.offset // 8  # whole blocks before the image (block_size 8)
    assert text_blocks >= 1
    (a,) = vlm.generate([{"prompt": text, "multi_modal_data": {"image": first}}], _greedy(), use_tqdm=False)
    (b,) = vlm.generate([{"prompt": text, "multi_modal_data": {"image": second}}], _greedy(), use_tqdm=False)
    # Same text, different image: the blocks before the image are shared, none from it on,
    # and the answer differs.
    assert b.num_cached_tokens == text_blocks * 8
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    (c,) = vlm.generate([{"prompt": text, "multi_modal_data": {"image": first}}], _greedy(), use_tqdm=False)
    assert c.num_cached_tokens > text_blocks * 8  # same text, same image: past the image too
    assert c.outputs[0].token_ids == a.outputs[0].token_ids


def test_encoder_cache_hit_for_the_same_image(vlm):
    cache = vlm.llm_engine.engine_core.runner.encoder_cache
    image = random_image(200)
    prompt = {"prompt": "First <image> here.", "multi_modal_data": {"image": image}}
    (a,) = vlm.generate([prompt], _greedy(), use_tqdm=False)
    hits, misses = cache.hits, cache.misses
    # The same request again with the prefix cache emptied: its KV is recomputed, the image
    # is not re-encoded, and the answer is the same.
    assert vlm.reset_prefix_cache()
    (b,) = vlm.generate([prompt], _greedy(), use_tqdm=False)
    assert b.num_cached_tokens == 0
    assert (cache.hits, cache.misses) == (hits + 1, misses)
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    # Other text around it, and the image twice in one prompt: encoded never again.
    (c,) = vlm.generate([{"prompt": "Second <image> and <image>.", "multi_modal_data": {"image": [image, image]}}],
                        _greedy(), use_tqdm=False)
    assert (cache.hits, cache.misses) == (hits + 3, misses)
    assert c.prompt_token_ids != a.prompt_token_ids


def test_chat_with_image_parts_matches_generate(vlm, tmp_path):
    image = random_image(300)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
    (chat,) = vlm.chat(messages, _greedy(), use_tqdm=False)
    text = "<|im_start|>user\n<image>What is this?<|im_end|>\n<|im_start|>assistant\n"
    (gen,) = vlm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], _greedy(), use_tqdm=False)
    assert chat.prompt_token_ids == gen.prompt_token_ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_refusals(vlm, tiny_idefics3_dir, default_llm):
    image = random_image(400)
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        vlm.generate([{"prompt": "One <image> only.", "multi_modal_data": {"image": [image, image]}}], use_tqdm=False)
    with pytest.raises(ValueError, match="does not take image inputs"):
        default_llm.generate([{"prompt": "x <image>", "multi_modal_data": {"image": image}}], use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data has 'audio'"):
        vlm.generate([{"prompt": "x", "multi_modal_data": {"audio": b""}}], use_tqdm=False)
    with pytest.raises(ValueError, match="not by beam search"):
        from pagedllm.engine.beam_search import BeamSearchParams

        vlm.beam_search([{"prompt": "x <image>", "multi_modal_data": {"image": image}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="PIL.Image"):
        vlm.generate([{"prompt": "x <image>", "multi_modal_data": {"image": "not an image"}}], use_tqdm=False)
    assert not vlm.llm_engine.has_unfinished_requests()


def test_limit_mm_per_prompt(tiny_idefics3_dir):
    llm = _engine(tiny_idefics3_dir, limit_mm_per_prompt={"image": 1})
    image = random_image(500)
    with pytest.raises(ValueError, match="2 images, more than this server's limit of 1 .*--limit-mm-per-prompt"):
        llm.generate([{"prompt": "<image> and <image>", "multi_modal_data": {"image": [image, image]}}],
                     use_tqdm=False)
    (out,) = llm.generate([{"prompt": "<image> only", "multi_modal_data": {"image": image}}],
                          SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_preemption_recomputes_images(tiny_idefics3_dir, hf_tiny_idefics3):
    """A pool of 13 blocks for three image prompts of ~7 blocks each: requests are preempted
    and resumed (recomputed from their images) and still match HF."""
    llm = LLM(tiny_idefics3_dir, dtype="float32", matmul_activations="float32", max_model_len=96,
              kv_cache_memory_bytes=14 * 8 * 512, block_size=8, enable_prefix_caching=False)
    prompts = _inputs(seed=20)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for prompt, out in zip(prompts, outs):
        ref, gaps = _hf_greedy_n(hf_tiny_idefics3, prompt, 24)
        assert_greedy_match(list(out.outputs[0].token_ids), ref, gaps, prompt["prompt"])


def test_tiled_images_match_hf(tiny_idefics3_tiled_dir):
    """SmolVLM's tiling: an image is up to 2 x 2 tiles and a global one (4 embeddings each, after row
    markers); two images of other shapes in one prompt, in chunks of 16 that cut through them."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    llm = _engine(tiny_idefics3_tiled_dir, max_num_batched_tokens=16, max_num_seqs=2)
    images = [random_image(40, 70, 40), random_image(41, 30, 64)]
    prompt = {"prompt": "Compare <image> with <image> please.", "multi_modal_data": {"image": images}}
    _, features = llm.llm_engine.input_processor.images.process(prompt["prompt"], images)
    assert [f.pixel_values.shape[0] for f in features] == [5, 3]  # 2 x 2 + 1, 1 x 2 + 1
    assert all(f.end - f.offset > f.num_embeds for f in features)  # runs interleaved with markers
    (out,) = llm.generate([prompt], _greedy(), use_tqdm=False)
    hf = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3_tiled_dir, dtype=torch.float32).eval()
    ref, gaps = hf_greedy_mm((hf, AutoProcessor.from_pretrained(tiny_idefics3_tiled_dir)), prompt)
    assert_greedy_match(list(out.outputs[0].token_ids), ref, gaps, "tiled")
