"""Build the sampler's per-step metadata from the runner's request states.

Python loops here run over requests (and their bad-word lists), never over the vocabulary;
token histories for penalties cross into torch as one padded tensor per step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm import faults
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.platforms.registry import platform_of
from pagedllm.sample.penalties import PenaltyMetadata
from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct generator seeds


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    # Accumulated over prompt chunks; None unless the request wants prompt logprobs and has
    # not sampled yet (a resumed request recomputes its prompt but reported them already).
    prompt_logprobs: list | None = None
    lora_request: LoRARequest | None = None  # the adapter the request runs with (lora/)
    pooling_params: PoolingParams | None = None  # a pooling request: pooled (worker/pooler.py), never sampled
    mm_features: list[MultiModalFeature] | None = None  # the prompt's images (worker/mm_embeds.py)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def step_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of a seeded request at output position ``step``: a function of
    (seed, step) only (and the device), so the tokens survive batching changes and
    preemption alike."""
    return torch.Generator(device=device).manual_seed((seed * _SEED_STRIDE + step) % (2**63))


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, eos_token_ids: list[int],
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """The metadata of ``states``' rows, on ``device`` (built on the host, one copy per tensor,
    no read back)."""
    md = _host_sampling_metadata(states, vocab_size, eos_token_ids, torch.device(device))
    return md if platform_of(device).uses_host_memory else _to_device(md, torch.device(device))


def _to_device(md: SamplingMetadata, device: torch.device) -> SamplingMetadata:
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, tuple):
            return tuple(move(v) for v in value)
        if isinstance(value, PenaltyMetadata):
            return PenaltyMetadata(*(move(getattr(value, f.name)) for f in fields(value)))
        return value

    return SamplingMetadata(**{f.name: move(getattr(md, f.name)) for f in fields(md)})


def _host_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, eos_token_ids: list[int], device: torch.device
) -> SamplingMetadata:
    faults.maybe_raise_any("sample", (s.req_id for s in states))
    params = [s.sampling_params for s in states]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
    top_k = top_p = min_p = None
    if any(p.top_k is not None for p in params):
        top_k = torch.tensor([p.top_k or vocab_size for p in params], dtype=torch.int64)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    banned_rows, banned_ids = _banned_tokens(states, eos_token_ids)
    logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(p.greedy for p in params),
        top_k=top_k,
        top_p=top_p,
        generators={
            i: step_generator(s.sampling_params.seed, s.num_output_tokens, device)
            for i, s in enumerate(states)
            if s.sampling_params.seed is not None and not s.sampling_params.greedy
        },
        banned_rows=torch.tensor(banned_rows, dtype=torch.int64) if banned_rows else None,
        banned_token_ids=torch.tensor(banned_ids, dtype=torch.int64) if banned_ids else None,
        min_p=min_p,
        allowed_mask=_allowed_mask(params, vocab_size),
        logit_bias=_logit_bias(params),
        penalties=_penalties(states, vocab_size),
        max_num_logprobs=max(logprob_ks) if logprob_ks else None,
    )


def _banned_tokens(
    states: list[CachedRequestState], eos_token_ids: list[int]
) -> tuple[list[int], list[int]]:
    """(row, token) pairs banned this step: stop tokens before min_tokens, and the last token
    of each bad word whose preceding tokens end the output so far."""
    rows: list[int] = []
    ids: list[int] = []
    for row, s in enumerate(states):
        p = s.sampling_params
        if s.num_output_tokens < p.min_tokens:
            stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_token_ids)
            rows += [row] * len(stop_ids)
            ids += stop_ids
        for word in p.bad_words_token_ids or ():
            prefix_len = len(word) - 1
            if prefix_len > s.num_output_tokens:
                continue
            if prefix_len == 0 or s.token_ids[-prefix_len:] == word[:-1]:
                rows.append(row)
                ids.append(word[-1])
    return rows, ids


def _allowed_mask(params: list[SamplingParams], vocab_size: int) -> torch.Tensor | None:
    if all(p.allowed_token_ids is None for p in params):
        return None
    mask = torch.ones(len(params), vocab_size, dtype=torch.bool)  # [B, V]
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            mask[row] = False
            mask[row, torch.tensor(p.allowed_token_ids, dtype=torch.int64)] = True
    return mask


def _logit_bias(
    params: list[SamplingParams],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row)
            ids.append(token_id)
            values.append(bias)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(values, dtype=torch.float32),
    )


def _padded(seqs: list[list[int]], pad: int) -> torch.Tensor:
    """Token lists -> [len(seqs), max_len] int64 padded with ``pad`` (numpy, one copy)."""
    out = np.full((len(seqs), max((len(x) for x in seqs), default=0) or 1), pad, dtype=np.int64)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = seq
    return torch.from_numpy(out)


def _penalties(states: list[CachedRequestState], vocab_size: int) -> PenaltyMetadata | None:
    params = [s.sampling_params for s in states]
    if not any(p.needs_penalties for p in params):
        return None
    # Rows without penalties get empty histories: their logits pass through unchanged.
    outputs = [s.token_ids[s.num_prompt_tokens :] if p.needs_penalties else [] for s, p in zip(states, params)]
    prompts = [
        s.token_ids[: s.num_prompt_tokens] if p.repetition_penalty != 1.0 else []
        for s, p in zip(states, params)
    ]
    return PenaltyMetadata(
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        output_token_ids=_padded(outputs, vocab_size),
        prompt_token_ids=_padded(prompts, vocab_size),
    )
