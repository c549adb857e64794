"""ModelRunner: SchedulerOutput -> flat batch -> model forward -> sampled tokens.

The runner keeps each scheduled request's token ids and block table between steps
(`CachedRequestState`); a SchedulerOutput carries only what changed. Per-step inputs (token
ids, positions, slot mapping, block tables) are built with numpy and cross into torch once,
and onto the KV worker's device (CUDA: the model's) once. The step then reads nothing back
from the device but the sampled tokens (one sync; logprobs, when asked, add their copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from pagedllm.config import AttentionConfig, ModelConfig, SpeculativeConfig
from pagedllm.core.sched_output import ModelRunnerOutput, PositionLogprobsData, SchedulerOutput
from pagedllm.kernels import paged_attention_ops
from pagedllm.attention.metadata import forward_context
from pagedllm.attention.registry import bind_backend
from pagedllm.layers.attention import Attention
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import lora_context
from pagedllm.lora.request import LoRARequest
from pagedllm.platforms.registry import platform_of
from pagedllm.pooling_params import PoolerConfig
from pagedllm.sample.logprobs import compute_logprobs
from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.policy import DraftPolicy
from pagedllm.spec_decode.proposer import PrefillChunk, Proposer
from pagedllm.spec_decode.registry import build_proposer
from pagedllm.worker.cuda_graphs import DecodeGraphs, cuda_graph_capture, eager_capture
from pagedllm.kv_backends.paged.worker import PagedKVWorker, attention_layers
from pagedllm.worker.fault_isolation import propose_isolated, sample_isolated, verify_isolated
from pagedllm.worker.kv_worker import KVCacheWorker, StepIndex
from pagedllm.worker.batch import Batch, build_batch, gather_input_ids
from pagedllm.worker.mm_embeds import EncoderCache, step_inputs_embeds
from pagedllm.worker.pooler import StepPooler
from pagedllm.worker.sampling_inputs import CachedRequestState

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        block_size: int,
        num_blocks: int,
        seed: int = 0,
        make_kv_worker: Callable[[list[Attention]], KVCacheWorker] | None = None,
        speculative_config: SpeculativeConfig | None = None,
        attention_config: AttentionConfig | None = None,
        decode_graph_sizes: Sequence[int] = (),
        lora_config: LoRAConfig | None = None,
        pooler_config: PoolerConfig | None = None,
        encoder_cache_size: int = 0,
    ) -> None:
        """``make_kv_worker`` builds the KV backend's worker side over the model's Attention
        layers (default: the paged pool of ``num_blocks`` blocks of ``block_size`` tokens;
        with another backend those two are unused). ``attention_config`` chooses the
        attention implementation of every layer. ``decode_graph_sizes``: decode steps run
        as graphs replayed at these batch sizes (worker/cuda_graphs.py; CUDA graphs on CUDA,
        a re-run of the captured function elsewhere). ``lora_config``: serve LoRA adapters
        (lora/manager.py; None: the base model only). ``pooler_config``: the model's resolved
        pooling (worker/pooler.py), for pooling requests; None: it takes none.
        ``encoder_cache_size``: embedding rows of encoded images kept (worker/mm_embeds.py),
        for a model that takes images."""
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        layers = attention_layers(model)
        self.kv_worker: KVCacheWorker = (
            make_kv_worker(layers) if make_kv_worker else PagedKVWorker(layers, num_blocks, block_size, model_config.dtype)
        )
        self.device = self.kv_worker.device
        self.platform = platform_of(self.device)
        # One backend for every layer (attention/registry.py; ValueError naming what it refuses).
        self.attn_backend = bind_backend(
            layers, attention_config or AttentionConfig(), self.kv_worker.layout, self.device
        )
        self.sampler = Sampler(seed, self.device)
        self.decode_graphs = self._decode_graphs(decode_graph_sizes) if decode_graph_sizes else None
        self.num_kv_cache_groups = self.kv_worker.num_groups
        self.kv_caches = self.kv_worker.kv_caches
        # Speculative decoding: every sampling request goes through the rejection sampler (a
        # request without drafts samples its one token there), so a seeded request's tokens
        # do not depend on whether others in the batch had drafts.
        self.speculative_config = spec = speculative_config
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.proposer: Proposer | None = None if spec is None else build_proposer(spec, self)
        self.draft_policy: DraftPolicy | None = None if spec is None else DraftPolicy(spec)
        self.lora_manager = self._lora_manager(lora_config) if lora_config is not None else None
        self.pooler = StepPooler(model, pooler_config) if pooler_config is not None else None
        self.encoder_cache = EncoderCache(encoder_cache_size) if model_config.multimodal_dir is not None else None
        # Build (or load the cached build of) the compiled kernels now, not in the first step.
        paged_attention_ops()

    def _decode_graphs(self, sizes: Sequence[int]) -> DecodeGraphs:
        """Decode forwards captured at these batch sizes: CUDA graphs, which only a backend
        whose decode reads device tensors alone may take; elsewhere a re-run."""
        graphs = self.platform.supports_graph_capture
        if graphs and not self.attn_backend.graph_capturable:
            raise ValueError(
                f"attention backend {self.attn_backend.name!r} cannot be captured in CUDA graphs "
                "(its decode reads host values of the step); use attention_backend='triton' or no cuda_graph_sizes"
            )
        capture = cuda_graph_capture() if graphs else eager_capture
        max_blocks = -(-self.model_config.max_model_len // self.block_size)
        return DecodeGraphs(self.model, sorted(set(sizes)), max_blocks, self.block_size, self.device, capture)

    def _lora_manager(self, lora_config: LoRAConfig) -> Any:
        """The LoRA adapters' manager over the model's Linear layers (lora/manager.py)."""
        from pagedllm.lora.manager import LoRAManager
        from pagedllm.models.registry import family_of

        packed = family_of(self.model_config.architecture).packed_modules
        dtype = getattr(torch, self.model_config.dtype)
        return LoRAManager(self.model, lora_config, packed, dtype, self.device)

    # ---- state -------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if self.lora_manager is not None:
            self.lora_manager.unpin(so.finished_req_ids)
            for new in so.scheduled_new_reqs:  # forks and beams come in here only
                if new.lora_request is not None:
                    self.lora_manager.pin(new.req_id, new.lora_request.lora_int_id)
        if self.draft_policy is not None:
            self.draft_policy.forget(so.finished_req_ids)
        if self.pooler is not None:
            self.pooler.forget(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            wants_prompt_logprobs = (
                params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens
            )
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=[list(g) for g in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                prompt_logprobs=[] if wants_prompt_logprobs else None,
                lora_request=new.lora_request,
                pooling_params=new.pooling_params,
                mm_features=new.mm_features,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for src, dst in cached.copied_blocks:
                for group in state.block_ids:
                    if src in group:
                        group[group.index(src)] = dst
            for group, new_ids in zip(state.block_ids, cached.new_block_ids):
                group.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- LoRA adapters -----------------------------------------------------------------

    def add_lora(self, request: LoRARequest, request_id: str | None = None) -> None:
        """Load and check an adapter (ValueError if refused, or if LoRA is not enabled); with
        ``request_id``, that unfinished request pins it (it stays loaded until it ends)."""
        if self.lora_manager is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} given, but LoRA is not enabled (--enable-lora)")
        self.lora_manager.add_adapter(request)
        if request_id is not None:
            self.lora_manager.pin(request_id, request.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (its slot freed once no unfinished request uses it)."""
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: input preparation, forward, logits processing, then sampling or
        speculation (verify, then propose)."""
        self._update_states(so)
        self.kv_worker.prepare(so)
        if so.blocks_to_copy and self.proposer is not None:  # a draft model's own KV blocks too
            self.proposer.copy_blocks(so.blocks_to_copy)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        step = self._prepare_step(so)
        hidden = self._forward(step)
        out = self._generate(so, step, hidden)
        if self.pooler is not None:
            out.pooler_output = self.pooler.pool(hidden, step.states, step.batch.query_start, step.batch.num_scheduled)
        return out

    def _generate(self, so: SchedulerOutput, step: _Step, hidden: torch.Tensor) -> ModelRunnerOutput:
        """The sampling (or verification and proposal) of the step's generating requests."""
        self._prompt_logprobs(hidden, step.states, step.batch)
        prefills = self._draft_prefills(step)
        sample_rows = step.batch.sample_rows
        if not sample_rows:
            if prefills:
                assert self.proposer is not None
                self.proposer.propose([], self.model_config.max_model_len, prefills)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        sampling_states = [step.states[i] for i in sample_rows]
        logits = self._logits(hidden, step.batch, sampling_states, so)
        if self.speculative_config is not None:
            drafts = [step.drafts[i] for i in sample_rows]
            return self._verify_and_propose(logits, sampling_states, drafts, prefills, len(step.states))
        return self._sample(logits, sampling_states)

    def _prepare_step(self, so: SchedulerOutput) -> _Step:
        """The flat batch of the scheduled requests, decodes (one query token) first: the
        attention backends batch them; and the step's LoRA mapping."""
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in req_ids]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
        batch = self.prepare_inputs(states, [so.num_scheduled_tokens[r] for r in req_ids], drafts)
        lora = None
        if self.lora_manager is not None:
            lora = self.lora_manager.prepare([s.lora_request for s in states], np.asarray(batch.num_scheduled))
        embeds = None
        if self.encoder_cache is not None:
            embeds = step_inputs_embeds(self.model, self.encoder_cache, states, batch.query_start,
                                        batch.num_scheduled, batch.input_ids)
        return _Step(states, drafts, batch, lora, embeds)

    def _forward(self, step: _Step) -> torch.Tensor:
        """Hidden states [T, hidden]: a captured decode graph where one takes the step, else
        the model under the step's attention metadata (and LoRA mapping)."""
        batch = step.batch
        if self.decode_graphs is not None and step.lora is None and step.inputs_embeds is None:
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.attn_metadata)
            if hidden is not None:
                return hidden
        with forward_context(batch.attn_metadata), lora_context(step.lora):
            if step.inputs_embeds is not None:
                return self.model(batch.input_ids, batch.positions, inputs_embeds=step.inputs_embeds)
            return self.model(batch.input_ids, batch.positions)

    def _draft_prefills(self, step: _Step) -> list[PrefillChunk]:
        """Prompt chunks that do not sample: a draft model computes their KV this step too."""
        sample_rows = step.batch.sample_rows
        if self.proposer is None or len(sample_rows) >= len(step.states):
            return []
        sampling = set(sample_rows)
        return [PrefillChunk(s, step.batch.num_scheduled[i]) for i, s in enumerate(step.states) if i not in sampling]

    def _logits(
        self, hidden: torch.Tensor, batch: Batch, sampling_states: list[CachedRequestState], so: SchedulerOutput
    ) -> torch.Tensor:
        """Logits at the sampled positions [num_logits, V] (speculative decoding: 1 + drafts
        rows per request), grammar-masked where asked."""
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if so.grammar_bitmask is not None:
            from pagedllm.structured_output.bitmask import apply_grammar_bitmask

            req_ids = [s.req_id for s in sampling_states]
            rows = [1 + len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids]
            apply_grammar_bitmask(logits, so.grammar_bitmask, req_ids, rows)
        return logits

    def _sample(self, logits: torch.Tensor, sampling_states: list[CachedRequestState]) -> ModelRunnerOutput:
        """One token per request (a request whose sampling raises fails alone:
        fault_isolation.py), appended to its state."""
        out, sampling_states, failed = sample_isolated(self.sampler, logits, sampling_states, self.eos_token_ids)
        if out is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed=failed)
        tokens = out.sampled_token_ids.tolist()
        logprobs: list[list[PositionLogprobsData] | None] | None = None
        if out.logprobs is not None:
            ks = [s.sampling_params.logprobs or 0 for s in sampling_states]
            lists = out.logprobs.tolists(ks)
            logprobs = [
                [entry] if s.sampling_params.logprobs is not None else None
                for s, entry in zip(sampling_states, lists)
            ]
        sampled = [[t] for t in tokens]
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in sampling_states],
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=_append_sampled(sampling_states, sampled),
            failed=failed,
        )

    def _verify_and_propose(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        drafts: list[list[int]],
        prefills: list[PrefillChunk],
        num_step_reqs: int,
    ) -> ModelRunnerOutput:
        """Speculative decoding: verify each request's drafts (logits: [sum(1 + k_r), V]),
        append the emitted tokens, then propose the next drafts for the requests the draft
        policy chooses (the step ran num_step_reqs requests)."""
        # A request whose verification or proposal raises fails alone (fault_isolation.py).
        verified, kept, failed = verify_isolated(self.rejection_sampler, logits, states, drafts, self.eos_token_ids)
        assert self.proposer is not None
        if verified is None:
            if prefills:
                self.proposer.propose([], self.model_config.max_model_len, prefills)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed=failed)
        tokens, logprobs = verified
        states = [states[i] for i in kept]
        assert self.draft_policy is not None
        req_ids = [s.req_id for s in states]
        self.draft_policy.observe(req_ids, [drafts[i] for i in kept], tokens)
        prompt_logprobs = _append_sampled(states, tokens)
        chosen = self.draft_policy.proposing(req_ids, num_step_reqs)
        # A request not drafted for still has its KV computed by a draft model that keeps its
        # own (its kept tokens, as a prompt chunk's): the draft's KV stays valid wherever the
        # target's is.
        chosen_set = set(chosen)
        skipped = [
            PrefillChunk(s, len(s.token_ids) - 1 - s.num_computed_tokens)
            for i, s in enumerate(states) if i not in chosen_set and len(s.token_ids) - 1 > s.num_computed_tokens
        ]
        drafted, failed_proposals = propose_isolated(
            self.proposer, [states[i] for i in chosen], self.model_config.max_model_len, [*prefills, *skipped]
        )
        proposals: list[list[int]] = [[] for _ in states]
        for i, d in zip(chosen, drafted):
            proposals[i] = d
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in states],
            sampled_token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            spec_token_ids=proposals,
            failed={**failed, **failed_proposals},
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, states: list[CachedRequestState], batch: Batch
    ) -> None:
        """Logprobs of the actual next prompt token at every prompt position this step
        computes, for requests that want them (accumulated across prefill chunks)."""
        for i, state in enumerate(states):
            if state.prompt_logprobs is None:
                continue
            start = batch.query_start[i]
            first = state.num_computed_tokens  # the position of its first token this step
            # Position p predicts prompt token p + 1; the last prompt position predicts output.
            end = min(first + batch.num_scheduled[i], state.num_prompt_tokens - 1)
            if end <= first:
                continue
            logits = self.model.compute_logits(hidden[start : start + end - first])  # [n, V]
            targets = torch.tensor(state.token_ids[first + 1 : end + 1], dtype=torch.int64, device=logits.device)
            k = state.sampling_params.prompt_logprobs or 0
            state.prompt_logprobs.extend(compute_logprobs(logits, targets, k).tolists([k] * len(targets)))

    def prepare_inputs(
        self, states: list[CachedRequestState], num_scheduled: list[int], drafts: list[list[int]] | None = None
    ) -> Batch:
        """The flat batch of ``num_scheduled[i]`` tokens of each state (its ``drafts[i]`` the
        last of them) from its ``num_computed_tokens`` on; decodes (one token) must come
        first. Proposers build their own passes with it (spec_decode/proposer.py)."""
        counts = np.asarray(num_scheduled, dtype=np.int64)  # [R]
        computed = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        # positions: [T], each request's run num_computed .. num_computed + count - 1
        req_of_token = np.repeat(np.arange(len(states)), counts)
        positions = np.arange(total) - np.repeat(query_start[:-1] - computed, counts)
        drafts = drafts or [[] for _ in states]
        num_drafts = np.asarray([len(d) for d in drafts], dtype=np.int64)  # [R]
        seq_lens = computed + counts
        num_decodes = int(np.argmax(counts != 1)) if (counts != 1).any() else len(states)
        input_ids = gather_input_ids(states, drafts, computed, counts, query_start, num_decodes)
        step = StepIndex(
            positions=torch.from_numpy(positions),
            req_of_token=torch.from_numpy(req_of_token),
            seq_lens=torch.from_numpy(seq_lens),
            query_start_loc=query_start.tolist(),
            seq_lens_list=seq_lens.tolist(),
            num_decodes=num_decodes,
        )
        md = self.kv_worker.attention_metadata([s.block_ids for s in states], step)
        prepare = self.attn_backend.prepare_metadata
        md = [prepare(m) for m in md] if isinstance(md, list) else prepare(md)
        batch = build_batch(states, input_ids, positions, md, query_start, seq_lens, counts, num_drafts)
        return batch if self.platform.uses_host_memory else batch.to(self.device)


def _append_sampled(
    states: list[CachedRequestState], emitted: list[list[int]]
) -> dict[str, list[PositionLogprobsData]]:
    """Append each request's emitted tokens to its state; hand over (once) the prompt
    logprobs it accumulated over its prefill chunks."""
    prompt_logprobs: dict[str, list[PositionLogprobsData]] = {}
    for state, tokens in zip(states, emitted):
        if state.prompt_logprobs is not None:
            prompt_logprobs[state.req_id] = state.prompt_logprobs
            state.prompt_logprobs = None
        state.token_ids.extend(tokens)
    return prompt_logprobs


class _Step(NamedTuple):
    """One step's prepared inputs (rows: requests, decodes first)."""

    states: list[CachedRequestState]
    drafts: list[list[int]]  # [R] each request's draft tokens (scored this step)
    batch: Batch
    lora: Any  # the step's LoRA mapping (lora/manager.py), None without adapters
    inputs_embeds: torch.Tensor | None = None  # [T, hidden] with image rows written in (worker/mm_embeds.py)
