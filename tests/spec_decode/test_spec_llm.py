"""Speculative decoding end to end on a tiny random-weight Llama: greedy outputs agree with
the engine without speculation (32 prompts in a mixed, chunked batch; the tie-aware rule of
DESIGN.md) for every proposer, and at temperature 1 the tokens produced through drafts follow
the model's distribution (chi-square at 1e-3, with a negative control)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import get_attention_metadata
from tests.sample.stats import SIGNIFICANCE, chi_square_p_value
from tests.utils import assert_same_greedy, tokens_and_gaps

NUM_STEPS = 32
ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory_bytes": "8MiB", "max_num_batched_tokens": 64, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, tiny_llama_dir):
    """A separate draft checkpoint: the tiny target cut to its first layer (same tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-draft")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def spec_prompts(default_tokenizer) -> list[list[int]]:
    """32 prompts of mixed lengths, the last long enough to need several chunks of 64 tokens."""
    rng = np.random.default_rng(3)
    vocab = len(default_tokenizer)
    prompts = [rng.integers(100, vocab, size=int(rng.integers(4, 40))).tolist() for _ in range(32)]
    prompts[-1] = rng.integers(100, vocab, size=300).tolist()
    return prompts


# A random model does not repeat itself; restricted to 12 tokens it must, so n-gram lookups
# find drafts (and the rejection sampler sees allowed_token_ids).
ALLOWED = list(range(1000, 1012))


def greedy_with_gaps(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of each prompt, plus the top-2 logprob gap at each step; four sampled
    requests (temperature 1) run in the same batch."""
    greedy = [
        SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True, logprobs=2,
                       allowed_token_ids=ALLOWED if i % 2 else None)
        for i in range(len(prompts))
    ]
    sampled = SamplingParams(max_tokens=NUM_STEPS, temperature=1.0, ignore_eos=True, seed=7)
    inputs = [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": p} for p in prompts[:4]]
    outs = llm.generate(inputs, greedy + [sampled] * 4, use_tqdm=False)
    for out in outs[len(prompts):]:
        assert len(out.outputs[0].token_ids) == NUM_STEPS
    return tokens_and_gaps(outs[: len(prompts)])


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, spec_prompts):
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS)
    return greedy_with_gaps(llm, spec_prompts)


def assert_all_blocks_free(llm: LLM) -> None:
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == llm.llm_engine.config.num_blocks - 1
    assert not llm.llm_engine.scheduler.has_unfinished_requests()


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 5}, id="ngram"),
        pytest.param({"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT"}, id="draft_model"),
        pytest.param({"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 1}, id="self_draft"),
        # ~36 blocks of 16 tokens: far less than the batch needs, so requests are preempted.
        pytest.param({"method": "ngram", "num_speculative_tokens": 4, "preempt": True}, id="ngram_preempted"),
        pytest.param({"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT", "preempt": True},
                     id="draft_model_preempted"),
    ],
)
def test_greedy_outputs_agree_with_and_without_speculation(
    tiny_llama_dir, tiny_draft_dir, spec_prompts, reference, spec
):
    if spec.get("model") == "DRAFT":
        spec = spec | {"model": tiny_draft_dir}
    preempt = spec.pop("preempt", False)
    args = ENGINE_ARGS | ({"kv_cache_memory_bytes": 37 * 8192, "max_model_len": 512} if preempt else {})
    llm = LLM(tiny_llama_dir, speculative_config=spec, **args)
    # Verification steps run through the fused decode (the compiled forward of every layer).
    fused = llm.llm_engine.engine_core.runner.model.model.fused_layers
    fused_runs = []
    handle = fused.register_forward_hook(lambda *_: fused_runs.append(get_attention_metadata(0).longest_query_run))
    try:
        tokens, _ = greedy_with_gaps(llm, spec_prompts)
    finally:
        handle.remove()
    assert sum(run > 1 for run in fused_runs) > 10
    ref_tokens, ref_gaps = reference
    for i, (ours, ref, gaps) in enumerate(zip(tokens, ref_tokens, ref_gaps)):
        assert len(ours) == NUM_STEPS
        assert_same_greedy(ours, ref, gaps, f"prompt {i}")
    stats = llm.llm_engine.scheduler.get_stats().spec_decoding_stats
    # The drafts were really exercised: some accepted, some rejected.
    assert stats.num_drafts > 30
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if preempt:
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny pool was meant to force preemption"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("spec", [
    pytest.param({"method": "ngram", "num_speculative_tokens": 4}, id="ngram"),
    pytest.param({"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT"}, id="draft_model"),
])
def test_greedy_outputs_agree_with_the_draft_policy(tiny_llama_dir, tiny_draft_dir, spec_prompts, reference, spec):
    """Drafts turned off for requests with poor acceptance (spec_decode/policy.py; the batch
    rule is tested model-free in test_policy.py): the outputs stay the target's, with a
    separate draft model too (whose KV of a skipped request is computed as a prompt chunk's)."""
    if spec.get("model") == "DRAFT":
        spec = spec | {"model": tiny_draft_dir}
    llm = LLM(tiny_llama_dir, speculative_config=spec | {"min_acceptance_rate": 0.3}, **ENGINE_ARGS)
    policy = llm.llm_engine.engine_core.runner.draft_policy
    decisions = []  # (requests that sampled, requests drafted for) per step
    proposing = policy.proposing

    def recorded(req_ids: list[str], num_step_reqs: int) -> list[int]:
        chosen = proposing(req_ids, num_step_reqs)
        decisions.append((len(req_ids), len(chosen)))
        return chosen

    policy.proposing = recorded
    tokens, _ = greedy_with_gaps(llm, spec_prompts[:12])
    ref_tokens, ref_gaps = reference
    for i, (ours, ref, gaps) in enumerate(zip(tokens, ref_tokens, ref_gaps)):
        assert_same_greedy(ours, ref, gaps, f"prompt {i}")
    stats = llm.llm_engine.scheduler.get_stats().spec_decoding_stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0
    assert any(drafted < sampled for sampled, drafted in decisions)  # some requests skipped
    assert_all_blocks_free(llm)


def test_separate_draft_cache_and_self_draft_propose_alike(tiny_llama_dir, tiny_draft_dir, spec_prompts):
    """The target's first layer as a separate checkpoint (its own KV cache, filled by
    catch-up passes) and as a self-draft (reusing the target's KV) draft the same tokens."""
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    stats = []
    for spec in ({"model": tiny_draft_dir}, {"draft_layers": 1}):
        llm = LLM(tiny_llama_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 3} | spec,
                  **ENGINE_ARGS)
        llm.generate([{"prompt_token_ids": p} for p in spec_prompts[:8]], params, use_tqdm=False)
        stats.append(llm.llm_engine.scheduler.get_stats().spec_decoding_stats)
        assert_all_blocks_free(llm)
    assert stats[0].num_drafts > 0 and stats[0] == stats[1]


def test_identical_draft_model_is_always_accepted(tiny_llama_dir, spec_prompts):
    """The target as its own draft: every greedy draft is the target's argmax."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_llama_dir}
    llm = LLM(tiny_llama_dir, speculative_config=spec, **ENGINE_ARGS)
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in spec_prompts[:8]], params, use_tqdm=False)
    stats = llm.llm_engine.scheduler.get_stats().spec_decoding_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens  # near-ties may flip
    assert_all_blocks_free(llm)


# ---- sampling at temperature 1 ------------------------------------------------------------

TOP_K = 4
NUM_SAMPLES = 1000  # sequences of 3 tokens
BASE = [345, 1200, 77, 9001, 512, 3003]  # the prompt repeats these; outputs are restricted to them


def exact_joint(hf_model, prompt: list[int], temperature: float) -> dict[tuple[int, ...], float]:
    """P(t0, t1, t2) under top-k sampling at ``temperature`` from HF's forward."""
    def dist(prefix: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prefix])).logits[0, -1].float() / temperature
        allowed = torch.tensor(BASE)
        top = logits[allowed].topk(TOP_K)
        return dict(zip(allowed[top.indices].tolist(), top.values.softmax(-1).tolist()))

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        joint = {
            seq + (t,): p * q for seq, p in joint.items() for t, q in dist(prompt + list(seq)).items()
        }
    return joint


def fit_p_value(samples: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> float:
    """Chi-square fit over the joint's cells, cells expected below 5 counts merged."""
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * len(samples) >= 5]
    index = {c: i for i, c in enumerate(big)}
    counts = torch.zeros(len(big) + 1)
    probs = torch.zeros(len(big) + 1)
    for c in cells:
        probs[index.get(c, len(big))] += joint[c]
    for s in samples:
        counts[index.get(s, len(big))] += 1
    return chi_square_p_value(counts, probs)


@pytest.mark.slow
def test_sampled_tokens_through_drafts_follow_the_model(tiny_llama_dir, hf_tiny_llama):
    prompt = BASE * 3  # every output token occurred before: n-gram lookup (min 1) always drafts
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(tiny_llama_dir, speculative_config=spec, dtype="float32", kv_cache_memory_bytes="32MiB",
              max_num_seqs=256)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, ignore_eos=True, allowed_token_ids=BASE)
    outs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params, use_tqdm=False)
    got = [tuple(o.outputs[0].token_ids) for o in outs]
    stats = llm.llm_engine.scheduler.get_stats().spec_decoding_stats
    # Positions 1 and 2 came through verification for (nearly) every sequence.
    assert stats.num_drafts >= 0.9 * NUM_SAMPLES
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert fit_p_value(got, exact_joint(hf_tiny_llama, prompt, 1.0)) > SIGNIFICANCE
    # Negative control: the same test rejects a slightly wrong model (temperature 1.3).
    assert fit_p_value(got, exact_joint(hf_tiny_llama, prompt, 1.3)) < SIGNIFICANCE
    assert_all_blocks_free(llm)


def _draft_kv(llm: LLM, req_id: str, num_positions: int) -> list[torch.Tensor]:
    """The draft model's K and V of ``req_id`` at positions [0, num_positions), per layer:
    [2, num_positions, num_kv_heads, head_dim], gathered through its block table."""
    runner = llm.llm_engine.engine_core.runner
    block_size = runner.block_size
    block_ids = torch.tensor(runner.requests[req_id].block_ids[0])
    positions = torch.arange(num_positions)
    blocks, offsets = block_ids[positions // block_size], positions % block_size
    return [cache[:, blocks, offsets] for cache in runner.proposer.kv_caches]


def test_forked_sequences_copy_the_draft_kv(tiny_llama_dir):
    """n=2 (greedy): the sequences fork after the leader computed all of the prompt but its
    last token, sharing its blocks; the partly filled last one is copied on write. The
    draft model's KV is copied with the target's: both sequences then hold the leader's
    draft KV of the prompt, and each accepts exactly the drafts an unforked run accepts.
    (The target as its own draft: its drafts are right where its draft KV is.)"""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_llama_dir}
    llm = LLM(tiny_llama_dir, speculative_config=spec, **ENGINE_ARGS)
    engine = llm.llm_engine
    scheduler = engine.scheduler
    block_size = engine.config.cache_config.block_size
    prompt = np.random.default_rng(5).integers(100, 1000, size=block_size + 12).tolist()
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)

    (unforked,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    single = scheduler.get_stats().spec_decoding_stats
    assert single.num_drafts > 0 and single.num_accepted_tokens > 0.9 * single.num_draft_tokens
    assert engine.reset_prefix_cache()

    engine.add_request({"prompt_token_ids": prompt}, dataclasses.replace(params, n=2), request_id="x")
    runner = engine.engine_core.runner
    outputs = []
    while "1_x" not in runner.requests:  # the leader's prompt, then the step that forks
        outputs += engine.step()
    leader, child = (runner.requests[r].block_ids[0] for r in ("0_x", "1_x"))
    num_full = (len(prompt) - 1) // block_size  # full blocks before the fork: shared
    assert leader[:num_full] == child[:num_full]
    assert leader[num_full] != child[num_full], "the last prompt block was meant to be copied"
    # Positions the leader computed before the fork (in the shared and the copied block).
    for theirs, ours in zip(_draft_kv(llm, "0_x", len(prompt) - 1), _draft_kv(llm, "1_x", len(prompt) - 1)):
        assert theirs.abs().sum() > 0
        assert torch.equal(theirs, ours)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (forked,) = [o for o in outputs if o.finished]
    assert [c.token_ids for c in forked.outputs] == [unforked.outputs[0].token_ids] * 2
    both = scheduler.get_stats().spec_decoding_stats
    assert (both.num_drafts, both.num_draft_tokens, both.num_accepted_tokens) == (
        2 * single.num_drafts, 2 * single.num_draft_tokens, 2 * single.num_accepted_tokens
    )
    assert both.num_accepted_tokens_per_pos == [2 * n for n in single.num_accepted_tokens_per_pos]
    assert_all_blocks_free(llm)


# Structured outputs under speculation: a regex of a few repeated words, so n-gram drafts
# are found (in the prompt and the output), while the draft model's drafts ignore the grammar.
SO_REGEX = "(abc|abd|xyz|x1){14}"


@pytest.mark.parametrize("spec", [
    pytest.param({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, id="ngram"),
    pytest.param({"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT"}, id="draft_model"),
])
def test_structured_outputs_with_speculation_match_without(tiny_llama_dir, tiny_draft_dir, default_tokenizer, spec):
    """Each verified position is masked by the grammar state after the drafts before it
    (drafts the grammar rejects are rejected): greedy outputs equal the non-speculative
    structured outputs (the tie-aware rule), follow the regex, and the drafts were used."""
    import re

    from pagedllm import StructuredOutputsParams

    if spec.get("model") == "DRAFT":
        spec = spec | {"model": tiny_draft_dir}
    prompts = [{"prompt_token_ids": default_tokenizer.encode("abcabdxyz" * (1 + i % 3) + "x1abc" * (i % 2),
                                                             add_special_tokens=False)} for i in range(8)]
    params = [SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, logprobs=2,
                             structured_outputs=StructuredOutputsParams(regex=SO_REGEX)) for _ in prompts]
    # Two unconstrained requests in the same batch.
    plain = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    inputs = prompts + prompts[:2]
    ref_llm = LLM(tiny_llama_dir, **ENGINE_ARGS)
    ref_outs = ref_llm.generate(inputs, params + [plain] * 2, use_tqdm=False)
    ref_tokens, ref_gaps = tokens_and_gaps(ref_outs[: len(prompts)])
    del ref_llm
    llm = LLM(tiny_llama_dir, speculative_config=spec, **ENGINE_ARGS)
    outs = llm.generate(inputs, params + [plain] * 2, use_tqdm=False)
    tokens, _ = tokens_and_gaps(outs[: len(prompts)])
    for i, (ours, ref, gaps, out) in enumerate(zip(tokens, ref_tokens, ref_gaps, outs)):
        assert re.fullmatch(SO_REGEX, out.outputs[0].text), out.outputs[0].text
        assert_same_greedy(ours, ref, gaps, f"prompt {i}")
    for ours, ref in zip(outs[len(prompts):], ref_outs[len(prompts):]):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
    stats = llm.llm_engine.scheduler.get_stats().spec_decoding_stats
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert_all_blocks_free(llm)
    assert llm.llm_engine.engine_core.structured_output.num_matchers == 0
