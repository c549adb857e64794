"""Speculative decoding in the runner: verify drafts, then propose the next ones.

Proposers draft deterministically (q one-hot), so the rejection sampler's acceptance
probability of a draft d is the target's p(d) and the output distribution is exact.
- ``NgramProposer`` (spec_decode/ngram.py): prompt lookup over prompt + output, numpy.
- ``DraftModelProposer``: greedy drafts from a smaller model with its own paged KV cache
  (same block ids as the target's), or from the target's first L layers with its final norm
  and head (self-speculation), which reuse the target's KV of those layers.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.config import SpeculativeConfig
from pagedllm.core.sched_output import PositionLogprobsData
from pagedllm.layers.attention import forward_context
from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.worker.kv_cache import allocate_kv_caches, attention_layers, kv_cache_groups
from pagedllm.worker.sampling_inputs import CachedRequestState, build_sampling_metadata

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner


def verify_drafts(
    sampler: RejectionSampler,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts: list[list[int]],
    eos_token_ids: list[int],
) -> tuple[list[list[int]], list[list[PositionLogprobsData] | None] | None]:
    """logits: [sum(1 + len(d)), V], each request's rows consecutive. Returns the emitted
    tokens per request and, for requests asking for them, logprobs per emitted token."""
    # Row j of a request is sampled as if its first j drafts were already output, so
    # penalties, bad words, min_tokens and seeded generators see exactly that history.
    row_states: list[CachedRequestState] = []
    for state, draft in zip(states, drafts):
        row_states.append(state)
        row_states.extend(
            dataclasses.replace(state, token_ids=state.token_ids + draft[:j]) for j in range(1, len(draft) + 1)
        )
    md = build_sampling_metadata(row_states, logits.shape[1], eos_token_ids)
    out = sampler(logits, md, drafts)
    if out.logprobs is None:
        return out.token_ids, None
    lists = out.logprobs.tolists([s.sampling_params.logprobs or 0 for s in row_states])
    logprobs: list[list[PositionLogprobsData] | None] = []
    row = 0
    for state, draft, emitted in zip(states, drafts, out.token_ids):
        wants = state.sampling_params.logprobs is not None
        logprobs.append(lists[row : row + len(emitted)] if wants else None)
        row += len(draft) + 1
    return out.token_ids, logprobs


class Proposer(ABC):
    """Drafts the next tokens of requests that just sampled."""

    num_speculative_tokens: int

    @abstractmethod
    def propose(self, states: list[CachedRequestState], max_model_len: int) -> list[list[int]]:
        """Drafts per state (each may be empty). The next step verifies position
        len(token_ids) - 1 plus the drafts, so at most max_model_len - 1 - len(token_ids)."""

    def max_drafts(self, states: list[CachedRequestState], max_model_len: int) -> list[int]:
        return [min(self.num_speculative_tokens, max_model_len - 1 - len(s.token_ids)) for s in states]


class NgramRunnerProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, states: list[CachedRequestState], max_model_len: int) -> list[list[int]]:
        return self.ngram.propose([s.token_ids for s in states], self.max_drafts(states, max_model_len))


class EarlyExitModel(nn.Module):
    """The target's first ``num_layers`` decoder layers, then its final norm and LM head
    (Llama-shaped models: ``model.embed_tokens``, ``model.layers``, ``model.norm``)."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        inner = getattr(target, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
            raise ValueError(
                f"speculative_config draft_layers: self-speculation needs a Llama-shaped model, "
                f"not {type(target).__name__}"
            )
        if not 1 <= num_layers < len(inner.layers):
            raise ValueError(
                f"speculative_config draft_layers={num_layers} must be in [1, {len(inner.layers) - 1}] "
                f"(the target has {len(inner.layers)} layers)"
            )
        # Plain attributes, not submodules: the target owns these weights.
        object.__setattr__(self, "target", target)
        self.num_layers = num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        inner = self.target.model
        hidden = inner.embed_tokens(input_ids)
        residual = None
        for layer in inner.layers[: self.num_layers]:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = inner.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class DraftModelProposer(Proposer):
    """Greedy drafts, k forward passes of the draft per step: a catch-up pass over the
    tokens whose draft KV is missing (the last sampled token; for a separate draft model
    also the accepted tokens and, once, the prompt), then k - 1 one-token passes."""

    def __init__(self, draft: nn.Module, runner: ModelRunner, k: int, shares_target_kv: bool) -> None:
        self.draft = draft
        self.runner = runner
        self.num_speculative_tokens = k
        self.shares_target_kv = shares_target_kv
        # Separate draft model: tokens of each request whose KV is in the draft's cache, keyed
        # by the runner's state object (a resumed request gets a new one, and new blocks).
        self.num_draft_computed: dict[str, tuple[CachedRequestState, int]] = {}

    def propose(self, states: list[CachedRequestState], max_model_len: int) -> list[list[int]]:
        caps = self.max_drafts(states, max_model_len)
        active = [i for i, cap in enumerate(caps) if cap > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not active:
            return drafts
        live = set(self.runner.requests)
        for req_id in [r for r in self.num_draft_computed if r not in live]:
            del self.num_draft_computed[req_id]
        views: list[CachedRequestState] = []
        counts: list[int] = []
        for i in active:
            s = states[i]
            start = len(s.token_ids) - 1
            if not self.shares_target_kv:
                owner, num_computed = self.num_draft_computed.get(s.req_id, (s, 0))
                start = min(num_computed if owner is s else 0, start)
                self.num_draft_computed[s.req_id] = (s, len(s.token_ids))
            views.append(dataclasses.replace(s, num_computed_tokens=start, token_ids=list(s.token_ids)))
            counts.append(len(s.token_ids) - start)
        live_views = list(range(len(views)))
        for step in range(max(caps[i] for i in active)):
            # Only requests still drafting run (a shorter cap near max_model_len stops early).
            live_views = [j for j in live_views if step < caps[active[j]]]
            order = sorted(live_views, key=lambda j: counts[j] != 1)  # decodes first
            batch = self.runner._prepare_inputs([views[j] for j in order], [counts[j] for j in order])
            with forward_context(batch.attn_metadata):
                hidden = self.draft(batch.input_ids, batch.positions)
            tokens = self.draft.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1).tolist()
            for j, token in zip(order, tokens):
                views[j].num_computed_tokens += counts[j]
                views[j].token_ids.append(token)
                drafts[active[j]].append(token)
                counts[j] = 1
        return drafts


def build_proposer(config: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    if config.method == "ngram":
        return NgramRunnerProposer(config)
    k = config.num_speculative_tokens
    if config.draft_layers is not None:
        return DraftModelProposer(EarlyExitModel(runner.model, config.draft_layers), runner, k, True)
    from pagedllm.models.loader import load_model

    assert config.model is not None
    model_config = runner.model_config
    loaded = load_model(config.model, dtype=model_config.dtype, max_model_len=model_config.max_model_len)
    if loaded.model_config.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"speculative_config model={config.model!r} has vocab size {loaded.model_config.vocab_size}, "
            f"the target {model_config.vocab_size}: the draft must share the target's tokenizer"
        )
    layers = attention_layers(loaded.model)
    if len(kv_cache_groups(layers)) != 1 or runner.num_kv_cache_groups != 1:
        raise ValueError("speculative_config model: draft and target must both be full-attention models")
    # The draft's own paged KV cache: same number of blocks and block size, so the target's
    # block ids index it too.
    runner.draft_kv_caches = allocate_kv_caches(layers, runner.num_blocks, runner.block_size, model_config.dtype)
    return DraftModelProposer(loaded.model, runner, k, False)
