"""End to end on the real default model (SmolLM2-135M-Instruct, GGUF Q4_1) against HF
transformers loading the same file, plus the request-lifecycle rules users rely on."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from tests.utils import assert_greedy_match, hf_greedy

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 plus 7?",
    "Give me a short tip for learning to code.",
    "Translate 'good morning' into Spanish.",
]


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_chat_token_ids_equal_hf_template(default_llm, default_tokenizer):
    for q in CHAT_PROMPTS[:3]:
        ours = default_llm.chat(_chat(q), SamplingParams(max_tokens=1), use_tqdm=False)[0]
        ref = default_tokenizer.apply_chat_template(_chat(q), tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ours.prompt_token_ids == list(ref)
        bos = default_tokenizer.bos_token_id
        if bos is not None:
            assert ours.prompt_token_ids[:2] != [bos, bos], "double BOS"


def test_chat_template_kwargs_reach_the_template(default_llm, default_tokenizer):
    template = "{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    params = SamplingParams(max_tokens=1)
    plain = default_llm.chat(_chat("Hi"), params, use_tqdm=False, chat_template=template)[0]
    greeted = default_llm.chat(
        _chat("Hi"), params, use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "Hello!"}
    )[0]
    assert plain.prompt_token_ids == default_tokenizer.encode("Hi", add_special_tokens=False)
    assert greeted.prompt_token_ids == default_tokenizer.encode("Hello! Hi", add_special_tokens=False)


def test_chat_with_tools_uses_the_tool_template(default_llm):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    history = [*_chat("Weather in Paris?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    (out,) = default_llm.chat(history, SamplingParams(max_tokens=1), use_tqdm=False, tools=[tool])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in out.prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in out.prompt
    assert '"tool_call_id": "call_1", "content": "sunny"' in out.prompt


def test_greedy_chat_matches_hf(default_llm, hf_default_model):
    eos = set(default_llm.llm_engine.model_config.eos_token_ids)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    outs = default_llm.chat([_chat(q) for q in CHAT_PROMPTS], params, use_tqdm=False)
    for q, out in zip(CHAT_PROMPTS, outs):
        ref, gaps = hf_greedy(hf_default_model, out.prompt_token_ids, 64, stop_ids=eos)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, q)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason == "stop"  # ends with the end-of-turn token


def test_stop_string_spanning_tokens(default_llm, default_tokenizer):
    prompt = "Count from one to twenty in words, separated by commas: one, two, three,"
    free = default_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert "seven" in text, text
    # A stop string that crosses a token boundary (", se" spans the comma token and "se...").
    stop = ", seven"
    assert not any(stop in default_tokenizer.decode([t]) for t in free.outputs[0].token_ids)
    out = default_llm.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    inc = default_llm.generate(
        [prompt],
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert inc.text == text[: text.index(stop) + len(stop)]
    assert default_llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == (
        default_llm.llm_engine.config.num_blocks - 1
    )


def test_min_tokens_and_stop_token_ids(default_llm):
    eos = set(default_llm.llm_engine.model_config.eos_token_ids)
    conv = _chat("Say just the word yes.")
    short = default_llm.chat(conv, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0]
    n = len(short.outputs[0].token_ids)
    assert short.outputs[0].token_ids[-1] in eos and n < 20
    longer = default_llm.chat(
        conv, SamplingParams(max_tokens=64, temperature=0.0, min_tokens=n + 5), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert not set(longer.token_ids[: n + 5]) & eos
    # A stop token id: the output ends at the first occurrence and says which token stopped it.
    first = short.outputs[0].token_ids[0]
    stopped = default_llm.chat(
        conv, SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == first
    assert stopped.finish_reason == "stop"


def test_ignore_eos_runs_to_length(default_llm):
    out = default_llm.chat(
        _chat("Say yes."), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"


def test_prompt_longer_than_max_model_len_is_rejected(default_llm):
    too_long = {"prompt_token_ids": [100] * 2048}
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.generate([too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    # Nothing was queued and the engine still serves.
    assert not default_llm.llm_engine.has_unfinished_requests()
    out = default_llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_invalid_sampling_params_raise():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
