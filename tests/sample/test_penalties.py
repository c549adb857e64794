"""Penalties, logit bias, allowed tokens and bad words change logits exactly as defined,
checked against a direct per-token computation; and parameter validation."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.sampler import apply_restrictions
from pagedllm.sample.penalties import apply_penalties
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling_inputs import CachedRequestState, build_sampling_metadata

VOCAB = 50
EOS = 2


def _state(prompt: list[int], output: list[int], **params) -> CachedRequestState:
    return CachedRequestState(
        req_id="r", token_ids=prompt + output, num_prompt_tokens=len(prompt),
        sampling_params=SamplingParams(**params), block_ids=[[]], num_computed_tokens=0,
    )


def _direct_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    out = logits.clone()
    for token in range(VOCAB):
        value = float(logits[token])
        if token in prompt or token in output:
            r = p.repetition_penalty
            value = value / r if value > 0 else value * r
        count = output.count(token)
        value -= p.frequency_penalty * count
        if count:
            value -= p.presence_penalty
        out[token] = value
    return out


def test_penalties_match_direct_computation():
    gen = torch.Generator().manual_seed(0)
    states = [
        _state([3, 4, 5, 5], [6, 6, 6, 7, 3], repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7),
        _state([10, 11], [11, 12, 12], presence_penalty=-0.4),
        _state([20], [21, 21], repetition_penalty=0.8),
        _state([30, 31], [30, 30, 30], temperature=0.5),  # no penalty: unchanged
        _state([40, 41, 42], [], frequency_penalty=1.0, repetition_penalty=1.5),
    ]
    logits = torch.randn(len(states), VOCAB, generator=gen) * 3
    md = build_sampling_metadata(states, VOCAB, [EOS])
    got = apply_penalties(logits, md.penalties)
    for row, s in enumerate(states):
        prompt, output = s.token_ids[: s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens :]
        want = _direct_penalties(logits[row], prompt, output, s.sampling_params)
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6)


def test_logit_bias_allowed_tokens_and_bad_words():
    states = [
        _state([1], [5, 6], logit_bias={7: 2.5, 8: -100}),
        _state([1], [5], allowed_token_ids=[3, 9, 11]),
        _state([1], [5, 6], bad_words=["x"]),
        _state([1], [5], min_tokens=3),
    ]
    # bad words as token sequences: [9] always banned; [6, 10] bans 10 after 6; [4, 12] not now
    states[2].sampling_params.bad_words_token_ids = [[9], [6, 10], [4, 12]]
    logits = torch.zeros(len(states), VOCAB)
    md = build_sampling_metadata(states, VOCAB, [EOS])
    got = apply_restrictions(logits, md)
    want = torch.zeros(len(states), VOCAB)
    want[0, 7], want[0, 8] = 2.5, -100.0
    want[1] = float("-inf")
    want[1, [3, 9, 11]] = 0.0
    want[2, [9, 10]] = float("-inf")
    want[3, EOS] = float("-inf")
    torch.testing.assert_close(got, want)


def test_bad_words_tokenized_with_and_without_leading_space(default_tokenizer):
    p = SamplingParams(bad_words=["hello world"])
    p.update_from_tokenizer(default_tokenizer)
    assert default_tokenizer.encode("hello world", add_special_tokens=False) in p.bad_words_token_ids
    assert default_tokenizer.encode(" hello world", add_special_tokens=False) in p.bad_words_token_ids


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(n=0), "n"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-3), "prompt_logprobs"),  # the upper bound: --max-logprobs (test_input_processor.py)
        (dict(logit_bias={1: 500.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-1.0), "temperature"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_keys_normalised_from_json():
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}
