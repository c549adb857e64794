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
