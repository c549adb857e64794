"""ModelRunner: SchedulerOutput -> flat batch -> model forward -> sampled tokens.

The runner keeps each scheduled request's token ids and block table between steps
(`CachedRequestState`); a SchedulerOutput carries only what changed. Per-step inputs (token
ids, positions, slot mapping, block tables) are built with numpy and cross into torch once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.attention import AttentionMetadata, forward_context
from pagedllm.layers.cpu_kernels import paged_attention_ops
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.kv_cache import allocate_kv_caches, attention_layers, kv_cache_groups

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    generator: torch.Generator | None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        block_size: int,
        num_blocks: int,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(seed)
        layers = attention_layers(model)
        self.num_kv_cache_groups = len(kv_cache_groups(layers))
        self.kv_caches = allocate_kv_caches(layers, num_blocks, block_size, model_config.dtype)
        # Build (or load the cached build of) the compiled kernels now, not in the first step.
        paged_attention_ops()

    # ---- state -------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None and not params.greedy:
                gen = torch.Generator().manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=[list(g) for g in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                generator=gen,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for group, new_ids in zip(state.block_ids, cached.new_block_ids):
                group.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        # Decodes (one query token) first: the attention backend batches them.
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in req_ids]
        batch = self._prepare_inputs(states, [so.num_scheduled_tokens[r] for r in req_ids])
        with forward_context(batch.attn_metadata):
            hidden = self.model(batch.input_ids, batch.positions)
        sample_rows = batch.sample_rows
        if not sample_rows:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampling_states = [states[i] for i in sample_rows]
        tokens = self.sampler(logits, self._sampling_metadata(sampling_states)).tolist()
        for state, token in zip(sampling_states, tokens):
            state.token_ids.append(token)
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in sampling_states],
            sampled_token_ids=[[t] for t in tokens],
        )

    def _prepare_inputs(self, states: list[CachedRequestState], num_scheduled: list[int]) -> _Batch:
        bs = self.block_size
        counts = np.asarray(num_scheduled, dtype=np.int64)  # [R]
        computed = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        # positions: [T], each request's run num_computed .. num_computed + count - 1
        req_of_token = np.repeat(np.arange(len(states)), counts)
        positions = np.arange(total) - np.repeat(query_start[:-1] - computed, counts)
        input_ids = np.empty(total, dtype=np.int64)
        for i, s in enumerate(states):
            input_ids[query_start[i] : query_start[i + 1]] = s.token_ids[computed[i] : computed[i] + counts[i]]
        seq_lens = computed + counts
        seq_lens_t, seq_lens_list = torch.from_numpy(seq_lens), seq_lens.tolist()
        query_start_list = query_start.tolist()
        num_decodes = int(np.argmax(counts != 1)) if (counts != 1).any() else len(states)
        max_blocks = int((seq_lens.max() + bs - 1) // bs)
        # Per KV cache group: its own block table and slots (sliding-window groups hold
        # other blocks than full-attention ones); the rest of the metadata is shared.
        mds: list[AttentionMetadata] = []
        for group in range(self.num_kv_cache_groups):
            block_tables = np.zeros((len(states), max_blocks), dtype=np.int64)
            for i, s in enumerate(states):
                ids = s.block_ids[group][:max_blocks]
                block_tables[i, : len(ids)] = ids
            slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs
            mds.append(
                AttentionMetadata(
                    slot_mapping=torch.from_numpy(slot_mapping),
                    block_tables=torch.from_numpy(block_tables),
                    seq_lens=seq_lens_t,
                    query_start_loc=query_start_list,
                    seq_lens_list=seq_lens_list,
                    num_decodes=num_decodes,
                    block_size=bs,
                )
            )
        # A request samples when this step reaches the end of its known tokens.
        sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids)]
        logits_indices = torch.from_numpy(query_start[1:][sample_rows] - 1)
        return _Batch(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            attn_metadata=mds[0] if len(mds) == 1 else mds,
            logits_indices=logits_indices,
            sample_rows=sample_rows,
        )

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        vocab = self.model_config.vocab_size
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
        top_k = top_p = None
        if any(p.top_k is not None for p in params):
            top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.int64)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, s in enumerate(states):
            p = s.sampling_params
            if len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
                stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                banned_rows += [row] * len(stop_ids)
                banned_ids += stop_ids
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all(p.greedy for p in params),
            top_k=top_k,
            top_p=top_p,
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            banned_rows=torch.tensor(banned_rows, dtype=torch.int64) if banned_rows else None,
            banned_token_ids=torch.tensor(banned_ids, dtype=torch.int64) if banned_ids else None,
        )


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata | list[AttentionMetadata]  # one, or one per KV group
    logits_indices: torch.Tensor  # [num_sampling] index into the flat batch
    sample_rows: list[int]  # which requests (rows of this step) sample
