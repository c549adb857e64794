"""Beam search equals HF transformers' generate(num_beams=k, num_return_sequences=k,
do_sample=False, length_penalty=..., early_stopping=True) in float32, on the tiny random
model and the default model, widths 2 and 4; dropped beams free their blocks.

Tie-aware rule for beams: the k sequences (best first) are identical with scores within 1e-3,
or at the first rank where they differ our score and the reference's are within 1e-3 of each
other (a near-tie that summation order may flip); nothing after that rank is compared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, BeamSearchParams

TOL = 1e-3


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=512, block_size=16,
               kv_cache_memory_bytes="16MiB", max_num_batched_tokens=128, max_num_seqs=32)


def _hf_beams(model, prompt: list[int], k: int, max_tokens: int, length_penalty: float, eos: list[int]):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
            length_penalty=length_penalty, early_stopping=True, max_new_tokens=max_tokens,
            eos_token_id=eos, pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True,
        )
    seqs = []
    for seq in out.sequences.tolist():
        # Strip padding after an EOS (HF pads shorter beams).
        gen = seq[len(prompt):]
        for i, t in enumerate(gen):
            if t in eos:
                gen = gen[: i + 1]
                break
        seqs.append(prompt + gen)
    return seqs, out.sequences_scores.tolist()


def _assert_beams_match(ours, ref_seqs, ref_scores, label):
    assert len(ours.sequences) == len(ref_seqs), label
    for rank, (seq, ref, ref_score) in enumerate(zip(ours.sequences, ref_seqs, ref_scores)):
        assert abs(seq.score - ref_score) < TOL, (label, rank, seq.score, ref_score)
        if seq.tokens != ref:
            return  # a near-tie (the scores agree): nothing after it is compared
    return


def _run(llm, hf_model, prompts, k, max_tokens, length_penalty, label):
    eos = list(llm.llm_engine.model_config.eos_token_ids)
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref_seqs, ref_scores = _hf_beams(hf_model, p, k, max_tokens, length_penalty, eos)
        _assert_beams_match(o, ref_seqs, ref_scores, f"{label} prompt {i}")
        assert [s.score for s in o.sequences] == sorted((s.score for s in o.sequences), reverse=True)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1, "blocks left behind"
    return outs


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.5)])
def test_beam_search_matches_hf_tiny(tiny_llm, hf_tiny_llama, default_tokenizer, k, length_penalty):
    rng = np.random.default_rng(k)
    prompts = [rng.integers(100, len(default_tokenizer), size=int(n)).tolist() for n in (7, 23, 40)]
    _run(tiny_llm, hf_tiny_llama, prompts, k, 12, length_penalty, f"tiny k={k}")


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_matches_hf_default(default_llm, hf_default_model, k):
    tok = default_llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("Say hi.",)
    ]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    outs = _run(default_llm, hf_default_model, ids, k, 24, 1.0, f"default k={k}")
    assert any(s.finish_reason == "stop" for o in outs for s in o.sequences)  # EOS was reached
    assert all(s.text is not None for o in outs for s in o.sequences)


def test_beams_share_blocks(tiny_llm, default_tokenizer):
    """During the search the beams hold the prompt's full blocks once."""
    engine = tiny_llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    seen: list[tuple[int, int]] = []
    step = engine.engine_core.step

    def spy():
        out = step()
        beams = [r.request_id for r in engine.scheduler.running]
        if len(beams) == 4:
            seen.append((kv.get_num_distinct_blocks(beams), sum(kv.get_num_blocks(b) for b in beams)))
        return out

    engine.engine_core.step = spy
    try:
        prompt = np.random.default_rng(0).integers(100, 40000, size=200).tolist()
        tiny_llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=8))
    finally:
        del engine.engine_core.step
    assert seen and all(distinct <= 200 // 16 + 4 < total for distinct, total in seen), seen


def test_beam_search_params_validation():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
