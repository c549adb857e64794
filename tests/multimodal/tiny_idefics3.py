"""A tiny random Idefics3 (SmolVLM) checkpoint with the default model's tokenizer plus the
image tokens, and its HF processor saved beside it (for tests/multimodal)."""

from __future__ import annotations

from typing import Any

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
IMAGE_SIZE = 32  # the vision tower's square input: (32 / 8)^2 = 16 patches
PATCH_SIZE = 8
SCALE_FACTOR = 2  # 16 patches -> 4 image tokens per image


def save_tiny_idefics3(path: str, tokenizer: Any, image_splitting: bool = False) -> None:
    """Save the checkpoint (safetensors), the tokenizer and the processor to ``path``.
    image_splitting: the processor tiles an image (SmolVLM's default) into up to 2 x 2 tiles
    of IMAGE_SIZE plus a global one, each tile's tokens after a <row_r_col_c> marker."""
    import torch
    from transformers import (
        Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor,
    )

    tokenizer = _with_image_tokens(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = dict(
        model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, initializer_range=0.2,
    )
    config = Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=SCALE_FACTOR, image_token_id=image_token_id,
        tie_word_embeddings=False,
    )
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # HF's init leaves the vision tower near-zero: make images matter
        for p in model.model.vision_model.parameters():
            p.normal_(0.0, 0.2)
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    longest = 2 * IMAGE_SIZE if image_splitting else IMAGE_SIZE
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=image_splitting, size={"longest_edge": longest}, max_image_size={"longest_edge": IMAGE_SIZE},
    )
    seq_len = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=seq_len, chat_template=_CHAT_TEMPLATE)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _with_image_tokens(tokenizer: Any) -> Any:
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tokenizer.image_token = "<image>"
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


# A SmolVLM-shaped template: an image part is "<image>" in the text, expanded by the processor.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
