"""Incremental detokenization: byte-level pieces of one character are held back until whole."""

from __future__ import annotations

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_processor import find_stop_string
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello 👋 world 🌍! Emoji 🧑‍💻 and flags 🇫🇷.",
    "中文测试：你好，世界。日本語もテストします。",
    "Mixed: naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑ ≠ ∞",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_clean_and_concatenate(default_tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    # The byte-level tokenizer really splits characters across tokens here.
    assert any("\ufffd" in default_tokenizer.decode([t]) for t in ids)
    prompt = default_tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, prompt)
    pieces = [detok.update([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == default_tokenizer.decode(ids, skip_special_tokens=True)


def test_find_stop_string_only_in_new_text():
    params = SamplingParams(stop=["END", "ab"])
    assert find_stop_string("xxENDyy", 2, params) is None  # match lies wholly in old text
    assert find_stop_string("xxEN", 1, params) is None
    assert find_stop_string("xxEND", 1, params) == ("END", 2)
    assert find_stop_string("zab and END", 10, params) == ("ab", 1)  # earliest wins
    inc = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    assert find_stop_string("xxEND", 3, inc) == ("END", 5)


def _wordpiece_tokenizer():
    """A tiny WordPiece tokenizer (its decoder joins tokens with spaces) with added tokens:
    special [A], [B] and a plain added <x>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(["[A]", "[B]"])
    raw.add_tokens(["<x>"])
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def _streamed(tokenizer, ids: list[int], **kwargs) -> str:
    detok = IncrementalDetokenizer(tokenizer, [], **kwargs)
    return "".join([detok.update([t]) for t in ids] + [detok.flush()])


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(spaces):
    tokenizer = _wordpiece_tokenizer()
    ids = tokenizer.encode("hello [A][B] worlds <x><x>", add_special_tokens=False)
    assert ids == [1, 4, 5, 2, 3, 6, 6]
    kept = _streamed(tokenizer, ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    # True: the decoder's own spacing; False: no space between two adjacent added tokens.
    assert kept == ("hello [A] [B] worlds <x> <x>" if spaces else "hello [A][B] worlds <x><x>")
    # With special tokens skipped the option does nothing (as in vLLM).
    skipped = _streamed(tokenizer, ids, skip_special_tokens=True, spaces_between_special_tokens=spaces)
    assert skipped == tokenizer.decode(ids, skip_special_tokens=True) == "hello worlds <x> <x>"


def test_spaces_between_special_tokens_change_nothing_byte_level(default_tokenizer):
    ids = default_tokenizer.encode("Hi<|im_end|><|im_start|>assistant\n ok<|im_end|>", add_special_tokens=False)
    plain = default_tokenizer.decode(ids, skip_special_tokens=False)
    for spaces in (True, False):
        assert _streamed(default_tokenizer, ids, skip_special_tokens=False, spaces_between_special_tokens=spaces) == plain


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_left_out_unless_asked(default_tokenizer, include):
    """A request the core stopped on a stop token: the token id is output, its text only with
    include_stop_str_in_output (as vLLM), even when special tokens are not skipped."""
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.engine.output_processor import OutputProcessor, RequestState

    ids = default_tokenizer.encode("Hi there", add_special_tokens=False)
    eos = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    processor = OutputProcessor(default_tokenizer)
    processor.add_request(RequestState("r", None, [1, 2], params, default_tokenizer, 0.0))
    processor.process_outputs([EngineCoreOutput("r", ids, None, None, 0)])
    done = processor.process_outputs([EngineCoreOutput("r", [eos], "stop", None, 0)])
    out = done.request_outputs[0].outputs[0]
    assert out.token_ids == ids + [eos]
    assert out.text == "Hi there" + ("<|im_end|>" if include else "")
