"""Prompts in: tokenize, apply chat templates, validate against the model's limits.

These calls are blocking (a 200,000-character prompt takes a third of a second to encode); the
server runs them on AsyncLLM's tokenizer thread, never on the event loop, and a request's own
chat template in a separate process (``entrypoints/openai/chat_renderer.py``)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple, Union

from pagedllm.config import ModelConfig
from pagedllm.multimodal.chat import extract_images, has_image_parts
from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.media import MediaConnector
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams

PromptType = Union[str, dict]
"""A string, {"prompt": str} or {"prompt_token_ids": [int, ...]}; a dict may also carry a
"cache_salt": requests with different salts never share cached prefix blocks, and with
{"prompt": str}, "multi_modal_data": {"image": PIL.Image | [PIL.Image, ...]} (the text writes
the model's image placeholder, e.g. "<image>", once per image)."""


class PromptInputs(NamedTuple):
    """A prompt made ready for the engine."""

    text: str | None
    token_ids: list[int]
    mm_features: list[MultiModalFeature] | None = None


@functools.cache
def _template_call_params(tokenizer_type: type) -> frozenset[str]:
    """apply_chat_template's own named parameters: not template variables."""
    params = inspect.signature(tokenizer_type.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name != "self")


class PromptTooLongError(ValueError):
    """A prompt text longer than max_model_len tokens could ever spell: refused before the
    tokenizer runs."""


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary decodes to, at most (byte-level BPE
    vocabularies write one character per byte, so a token's vocabulary string is never
    shorter than its text); 0 if the tokenizer lists no vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 (a tokenizer without get_vocab: no bound)
        return 0
    return max((len(t) for t in vocab), default=0)


class InputProcessor:
    def __init__(self, tokenizer: Any, model_config: ModelConfig, speculative_config: object | None = None,
                 max_logprobs: int = MAX_LOGPROBS, multimodal_config: MultiModalConfig | None = None) -> None:
        from pagedllm.multimodal.processor import image_processor_for

        self.tokenizer = tokenizer
        mm_config = multimodal_config or MultiModalConfig()
        self.images = image_processor_for(model_config, mm_config)
        """The model's image preprocessing; None for a text-only model."""
        self.media = MediaConnector(mm_config)
        self.model_config = model_config
        # The thinking budget is refused while speculative decoding is on (see validate).
        self.speculative_config = speculative_config
        self.max_logprobs = max_logprobs
        per_token = longest_token_chars(tokenizer)
        self.max_prompt_chars = model_config.max_model_len * per_token if per_token else None
        """A prompt text longer than this cannot fit in max_model_len tokens (each token spells
        at most the vocabulary's longest): PromptTooLongError before tokenizing it."""

    def check_prompt_chars(self, text: str) -> None:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the prompt has {len(text)} characters, more than max_model_len="
                f"{self.model_config.max_model_len} tokens of this tokenizer can spell "
                f"({self.max_prompt_chars} characters); shorten the prompt")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids); ValueError for a prompt with images
        (tokenize_prompt takes them: generate and chat)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError("multi_modal_data is taken by generate and chat only (not by beam search or pooling)")
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.encode(prompt["prompt"])
        raise ValueError(
            f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
            f"got {type(prompt).__name__}"
        )

    def tokenize_prompt(self, prompt: PromptType) -> PromptInputs:
        """tokenize(), and a prompt's "multi_modal_data" preprocessed (blocking: the server
        calls this on a worker thread)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return PromptInputs(*self.tokenize(prompt))
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data has {unknown[0]!r}; supported: 'image'")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError('a prompt with multi_modal_data needs its text as "prompt" (token ids cannot place images)')
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        self.check_prompt_chars(text)
        ids, features = self.require_images().process(text, list(images), add_special_tokens=True)
        return PromptInputs(text, ids, features)

    def require_images(self) -> Any:
        """The image processor; ValueError when the model takes no images."""
        if self.images is None:
            raise ValueError(
                f"model {self.model_config.model!r} ({self.model_config.architecture}) does not take image inputs")
        return self.images

    def render_chat_inputs(
        self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None, *,
        continue_final_message: bool = False, documents: list[dict] | None = None, add_special_tokens: bool = False,
    ) -> PromptInputs:
        """render_chat with image parts (image_url, image_pil) loaded and expanded (blocking)."""
        if not has_image_parts(messages):
            return PromptInputs(*self.render_chat(
                messages, chat_template, add_generation_prompt, chat_template_kwargs, tools,
                continue_final_message=continue_final_message, documents=documents,
                add_special_tokens=add_special_tokens))
        processor = self.require_images()
        messages, images = extract_images(messages, self.media)
        processor.check_count(len(images))
        text = render_chat_text(self.tokenizer, messages, chat_template, add_generation_prompt, chat_template_kwargs,
                                tools, continue_final_message=continue_final_message, documents=documents)
        self.check_prompt_chars(text)
        ids, features = processor.process(text, images, add_special_tokens=add_special_tokens)
        return PromptInputs(text, ids, features)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; add_special_tokens=False: the text's own tokens, no BOS added.
        PromptTooLongError if the text could not fit in max_model_len tokens."""
        self.check_prompt_chars(text)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not add_special_tokens:
            return ids
        bos = self.model_config.bos_token_id
        # A prompt that already starts with the BOS text must not get a second BOS.
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def render_chat(
        self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None, *,
        continue_final_message: bool = False, documents: list[dict] | None = None, add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """Apply the chat template; the ids equal HF's `apply_chat_template(tokenize=True)`."""
        text = render_chat_text(self.tokenizer, messages, chat_template, add_generation_prompt, chat_template_kwargs,
                                tools, continue_final_message=continue_final_message, documents=documents)
        return text, self.encode_rendered(text, add_special_tokens)

    def encode_rendered(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat prompt's ids: the template writes any BOS itself, so by default no
        special tokens are added again (add_special_tokens=True adds them, as vLLM's field)."""
        self.check_prompt_chars(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check the prompt against the model; return the resolved max_tokens."""
        n = len(prompt_token_ids)
        max_len = self.model_config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if n >= max_len:
            raise ValueError(
                f"the prompt has {n} tokens, but max_model_len is {max_len}, which leaves no "
                f"room for output; shorten the prompt or raise max_model_len"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name}={value} is more than this engine's max_logprobs={self.max_logprobs} "
                    "(--max-logprobs)"
                )
        params.validate_vocab(vocab)
        params.update_from_tokenizer(self.tokenizer)
        if params.thinking_token_budget is not None and self.speculative_config is not None:
            # The forced end marker is a bitmask row for the sampled position alone (reasoning/budget.py).
            raise ValueError("thinking_token_budget cannot be combined with speculative decoding yet; "
                             "start the engine without a speculative config to bound the reasoning")
        if params.structured_outputs is not None:
            from pagedllm.structured_output import validate

            validate(params.structured_outputs)
        room = max_len - n
        if params.max_tokens is None:
            return room
        return min(params.max_tokens, room)


def render_chat_text(
    tokenizer: Any, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None, *,
    continue_final_message: bool = False, documents: list[dict] | None = None,
) -> str:
    """The chat template applied to the messages (ValueError if it refuses them); ``tools``
    (OpenAI's tool objects) are the template's ``tools`` variable.

    chat_template_kwargs are variables for the template (e.g. `enable_thinking`); as in
    vLLM, an `add_generation_prompt` among them overrides the argument. A key naming one of
    apply_chat_template's own parameters is refused: it would change the call, not the template.
    continue_final_message: the last (assistant) message is left open for the model to go on
    (no end-of-turn after it). documents: handed to the template (retrieval templates).
    """
    variables = dict(chat_template_kwargs or {})
    add_generation_prompt = variables.pop("add_generation_prompt", add_generation_prompt)
    reserved = sorted(set(variables) & _template_call_params(type(tokenizer)))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: they are parameters of the "
            "template call, not template variables"
        )
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=bool(add_generation_prompt),
            continue_final_message=continue_final_message,
            documents=documents,
            **variables,
        )
    except Exception as e:  # jinja errors, raise_exception() in templates
        raise ValueError(f"the chat template rejected the messages: {e}") from e
