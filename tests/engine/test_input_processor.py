"""Chat rendering: chat_template_kwargs are the template's variables."""

from __future__ import annotations

import pytest

from pagedllm.config import ModelConfig
from pagedllm.engine.input_processor import InputProcessor

TEMPLATE = "{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "How are you?"}]


@pytest.fixture
def processor(default_tokenizer):
    config = ModelConfig(model="m", architecture="LlamaForCausalLM", dtype="float32", max_model_len=64,
                         vocab_size=len(default_tokenizer), num_layers=1, num_kv_heads=1, head_dim=8,
                         eos_token_ids=(2,))
    return InputProcessor(default_tokenizer, config)


def test_chat_template_kwargs_reach_the_template(processor):
    assert processor.render_chat(MESSAGES, TEMPLATE)[0] == "How are you?"
    text, ids = processor.render_chat(MESSAGES, TEMPLATE, chat_template_kwargs={"greeting": "Bonjour!"})
    assert text == "Bonjour! How are you?"
    assert ids == processor.tokenizer.encode(text, add_special_tokens=False)


def test_add_generation_prompt_among_the_kwargs_overrides(processor):
    with_prompt = processor.render_chat(MESSAGES)[0]
    assert with_prompt.endswith("<|im_start|>assistant\n")
    without = processor.render_chat(MESSAGES, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert without == with_prompt[: -len("<|im_start|>assistant\n")]


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "return_dict"])
def test_call_parameters_are_refused(processor, key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set {key}"):
        processor.render_chat(MESSAGES, chat_template_kwargs={key: True})


def test_max_logprobs_bounds_logprobs_and_prompt_logprobs(processor):
    from pagedllm.sampling_params import SamplingParams

    ids = processor.tokenizer.encode("Hello")
    for name in ("logprobs", "prompt_logprobs"):
        processor.validate(ids, SamplingParams(max_tokens=1, **{name: 20}))
        with pytest.raises(ValueError, match=f"{name}=21 is more than this engine's max_logprobs=20"):
            processor.validate(ids, SamplingParams(max_tokens=1, **{name: 21}))
    processor.max_logprobs = 50  # --max-logprobs 50
    processor.validate(ids, SamplingParams(max_tokens=1, logprobs=50))


def test_continue_final_message_and_documents_reach_the_template(processor):
    template = "{% for d in documents or [] %}<{{ d['text'] }}>{% endfor %}{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    messages = [*MESSAGES, {"role": "assistant", "content": "Fine"}]
    text, _ = processor.render_chat(messages, template, add_generation_prompt=False,
                                    documents=[{"text": "doc"}])
    assert text == "<doc>How are you?|Fine|"
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        processor.render_chat(messages, continue_final_message=True)
    open_text, _ = processor.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert open_text.endswith("Fine")


def test_thinking_budget_refused_with_speculative_decoding(processor):
    from pagedllm.sampling_params import SamplingParams

    assert processor.validate([1, 2], SamplingParams(max_tokens=4, thinking_token_budget=2)) == 4
    processor.speculative_config = object()
    with pytest.raises(ValueError, match="thinking_token_budget cannot be combined with speculative decoding"):
        processor.validate([1, 2], SamplingParams(max_tokens=4, thinking_token_budget=2))
