"""Draft-model proposer: greedy drafts from a smaller model, or from the target's first
layers (self-speculation, early_exit.py).

A separate draft model owns a KV cache of the target's pool shape (as many blocks of the
same size), so the target's block ids index it too; the target's KV worker makes it (the
``DraftKVHost`` capability, proposer.py). Invariant: the draft's KV is valid
at every position where the target's is. Each step the draft first computes what the
target computed and kept (from the step's first position to the end of the emitted
tokens; prompt chunks that did not sample too), and the runner has it copy its blocks when
the target's are copied (copy-on-write of a fork). So what the target's cache holds for a
request (a prefix-cache hit, blocks shared with the sequence it forked from, a resumed
request's prefix) the draft's holds too; only the KV at its own drafts' positions is stale,
and it is rewritten before it is read. A self-draft's layers are the target's: the target
wrote their KV already.

Per step, k forward passes of the draft: one over the tokens whose draft KV is missing (for
a decode: the last sampled token, the accepted drafts and the new token; a self-draft: the
new token only), then k - 1 one-token passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.metadata import forward_context
from pagedllm.spec_decode.early_exit import EarlyExitModel
from pagedllm.spec_decode.proposer import DraftKV, DraftKVHost, PrefillChunk, Proposer, RunnerView

if TYPE_CHECKING:
    from pagedllm.config import SpeculativeConfig
    from pagedllm.worker.sampling_inputs import CachedRequestState


class DraftModelProposer(Proposer):
    def __init__(self, draft: nn.Module, runner: RunnerView, k: int, draft_kv: DraftKV | None) -> None:
        """``draft_kv``: the draft's own, bound to its attention layers; None for a
        self-draft, which reads and writes the target's."""
        self.draft = draft
        self.runner = runner
        self.num_speculative_tokens = k
        self.draft_kv = draft_kv

    @property
    def kv_caches(self) -> list[torch.Tensor] | None:
        return self.draft_kv.kv_caches if self.draft_kv is not None else None

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        if self.draft_kv is not None:
            self.draft_kv.copy_blocks(blocks_to_copy)

    def propose(
        self, states: list[CachedRequestState], max_model_len: int, prefills: Sequence[PrefillChunk] = ()
    ) -> list[list[int]]:
        caps = self.max_drafts(states, max_model_len)
        drafts: list[list[int]] = [[] for _ in states]
        owns_kv = self.draft_kv is not None
        # One view per request of this pass: its first position and token count, and which
        # state it drafts for (None: a prompt chunk, whose draft KV is only written).
        views: list[CachedRequestState] = []
        counts: list[int] = []
        drafting: list[int | None] = []
        for i, (s, cap) in enumerate(zip(states, caps)):
            if cap <= 0:  # at max_model_len: it stops at the next step
                continue
            start = s.num_computed_tokens if owns_kv else len(s.token_ids) - 1
            views.append(dataclasses.replace(s, num_computed_tokens=start, token_ids=list(s.token_ids)))
            counts.append(len(s.token_ids) - start)
            drafting.append(i)
        if owns_kv:
            for chunk in prefills:
                views.append(chunk.state)
                counts.append(chunk.num_tokens)
                drafting.append(None)
        live = list(range(len(views)))
        step = 0
        while live:
            order = sorted(live, key=lambda j: counts[j] != 1)  # decodes first
            batch = self.runner.prepare_inputs([views[j] for j in order], [counts[j] for j in order])
            with forward_context(batch.attn_metadata):
                hidden = self.draft(batch.input_ids, batch.positions)
            # Drafting views reach the end of their tokens: they have the logits rows, in order.
            sampling = [j for j in order if drafting[j] is not None]
            tokens: list[int] = []
            if sampling:
                tokens = self.draft.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1).tolist()
            for j, token in zip(sampling, tokens):
                views[j].num_computed_tokens += counts[j]
                views[j].token_ids.append(token)
                drafts[drafting[j]].append(token)
                counts[j] = 1
            step += 1
            # Only requests still drafting run on (a shorter cap near max_model_len stops early).
            live = [j for j in sampling if step < caps[drafting[j]]]
        return drafts


def build_draft_proposer(config: SpeculativeConfig, runner: RunnerView) -> DraftModelProposer:
    k = config.num_speculative_tokens
    if config.draft_layers is not None:
        return DraftModelProposer(EarlyExitModel(runner.model, config.draft_layers), runner, k, None)
    from pagedllm.models.loader import load_model

    assert config.model is not None
    model_config = runner.model_config
    loaded = load_model(config.model, dtype=model_config.dtype, max_model_len=model_config.max_model_len)
    if loaded.model_config.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"speculative_config model={config.model!r} has vocab size {loaded.model_config.vocab_size}, "
            f"the target {model_config.vocab_size}: the draft must share the target's tokenizer"
        )
    host = runner.kv_worker
    if not isinstance(host, DraftKVHost):
        raise ValueError(
            f"speculative_config model: the KV worker {type(host).__name__} cannot hold a draft "
            "model's KV cache; use kv_cache_backend='paged'"
        )
    return DraftModelProposer(loaded.model, runner, k, host.make_draft_kv(loaded.model, model_config.dtype))
