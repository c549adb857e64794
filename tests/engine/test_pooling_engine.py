"""Pooling requests in the engine: prefill-only, beside generation in one step on a causal
model, over chunked prefill (the pooling carried across chunks), with the prefix cache where
the pooling reads only the last token, and whole prompts per step for bidirectional models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.outputs import PoolingRequestOutput
from tests.models.pooling_utils import TEXTS, save_decoder, save_encoder

LONG = TEXTS[2] * 2  # 150 tokens of the tiny tokenizer


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", matmul_activations="float32", kv_cache_memory_bytes="8MiB", **kwargs)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    save_decoder(path, "Qwen3ForCausalLM")
    return path


@pytest.fixture(scope="module")
def decoder(decoder_dir: Path) -> LLM:
    return _llm(decoder_dir)


def test_generation_and_embedding_share_a_step(decoder: LLM) -> None:
    """A causal LM under the generate runner embeds too: an embedding and a generation
    request scheduled in the same step, each getting what it gets alone."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone_tokens = decoder.generate([TEXTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    alone_vector = decoder.embed([TEXTS[1]])[0].outputs.embedding
    engine = decoder.llm_engine
    gen_id = engine.add_request(TEXTS[0], greedy)
    emb_id = engine.add_request(TEXTS[1], PoolingParams())
    first = {out.request_id: out for out in engine.step()}
    assert set(first) == {gen_id, emb_id}  # one step ran both prompts
    assert isinstance(first[emb_id], PoolingRequestOutput) and first[emb_id].finished
    assert first[emb_id].outputs.embedding == pytest.approx(alone_vector, abs=1e-5)
    assert not first[gen_id].finished
    tokens = list(first[gen_id].outputs[0].token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    assert tokens == alone_tokens


@pytest.mark.parametrize("pooling_type", ["MEAN", "LAST", "CLS"])
def test_chunked_prefill_pools_the_whole_prompt(decoder_dir: Path, pooling_type: str) -> None:
    """A prompt run in chunks of 32 tokens pools as the same prompt run whole."""
    config = {"pooling_type": pooling_type, "normalize": False}
    whole = _llm(decoder_dir, pooler_config=config).embed([LONG, TEXTS[0]])
    chunked_llm = _llm(decoder_dir, pooler_config=config, max_num_batched_tokens=32, max_num_seqs=4,
                       enable_prefix_caching=False)
    chunked = chunked_llm.embed([LONG, TEXTS[0]])
    assert len(whole[0].prompt_token_ids) > 32 * 3
    for a, b in zip(whole, chunked):
        assert torch.allclose(torch.tensor(a.outputs.data), torch.tensor(b.outputs.data), atol=1e-4)


def test_prefix_cache_only_where_the_pooling_reads_the_last_token(decoder_dir: Path) -> None:
    last = _llm(decoder_dir)  # LAST: a cached prefix leaves the last token to compute
    first, again = last.embed([LONG]), last.embed([LONG])
    assert again[0].num_cached_tokens > 0
    assert again[0].outputs.embedding == pytest.approx(first[0].outputs.embedding, abs=1e-5)
    mean = _llm(decoder_dir, pooler_config={"pooling_type": "MEAN"})
    mean.embed([LONG])
    assert mean.embed([LONG])[0].num_cached_tokens == 0


def test_bidirectional_prompts_run_whole(tmp_path: Path) -> None:
    """BERT with a step budget below its prompts: each prompt still runs in one step (the
    budget is raised to max_model_len), no prefix is shared, and a batch larger than one step
    gives each text its vector alone."""
    save_encoder(tmp_path, "BertModel", "mean")
    llm = _llm(tmp_path, max_num_batched_tokens=16, max_num_seqs=8)
    sched = llm.llm_engine.config.scheduler_config
    assert sched.whole_prompts and sched.max_num_batched_tokens == sched.max_model_len == 128
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching
    # 30-50 tokens each: a step's budget left after two or three is less than the next prompt.
    texts = [f"{TEXTS[2]} {t}" for t in TEXTS]
    batch = llm.embed(texts)
    for text, out in zip(texts, batch):
        alone = llm.embed([text])[0].outputs.embedding
        assert out.outputs.embedding == pytest.approx(alone, abs=1e-4)
