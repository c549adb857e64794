"""`pagedllm serve --speculative-config`: the official openai client gets the same greedy
text as without speculation (structured outputs too), /metrics counts drafts, the stats line
shows the acceptance."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.entrypoints.utils import RemoteServer, metric_value

ALLOWED = list(range(1000, 1012))  # a restricted random model repeats itself: n-gram drafts
SO_REGEX = "(abc|abd|xyz|x1){10}"  # a grammar of repeated words: n-gram drafts too
SO_PROMPT = "abcabdxyzx1abcabd"


@pytest.mark.slow
def test_server_with_ngram_speculation(tiny_llama_dir):
    import openai

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompt = [1000, 1001, 1002, 1003, 1000, 1001]
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB")
    want = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=ALLOWED),
        use_tqdm=False,
    )[0].outputs[0].text
    want_structured = llm.generate(
        [SO_PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                    structured_outputs=StructuredOutputsParams(regex=SO_REGEX)),
        use_tqdm=False,
    )[0].outputs[0].text

    server = RemoteServer(
        ["--dtype", "float32", "--kv-cache-memory-bytes", "8MiB", "--speculative-config", json.dumps(spec)],
        model=tiny_llama_dir,
        # Faults inside one request's draft proposal or verification (pagedllm/faults.py).
        env={"PAGEDLLM_INJECT_FAULT": "propose:poison-propose,sample:poison-verify"},
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120)

        def complete(request_id: str | None = None):
            extra = {"allowed_token_ids": ALLOWED, "ignore_eos": True}
            return client.completions.create(
                model=tiny_llama_dir, prompt=prompt, max_tokens=24, temperature=0,
                extra_body={**extra, "request_id": request_id} if request_id else extra,
            )

        def outcome(request_id: str | None):
            try:
                return complete(request_id)
            except openai.APIStatusError as e:
                return e

        # Poisoned requests beside a healthy one: they fail alone (500), it is unaffected.
        with ThreadPoolExecutor(3) as pool:
            out, *poisoned = pool.map(outcome, [None, "poison-propose-1", "poison-verify-1"])
        for err, site in zip(poisoned, ["propose", "sample"]):
            assert isinstance(err, openai.APIStatusError) and err.status_code == 500, err
            assert f"injected fault at {site} for" in err.message, err.message
        assert out.choices[0].text == want
        assert out.usage.completion_tokens == 24
        structured = client.completions.create(model=tiny_llama_dir, prompt=SO_PROMPT, max_tokens=40, temperature=0,
                                               extra_body={"structured_outputs": {"regex": SO_REGEX}})
        assert structured.choices[0].text == want_structured
        deadline = time.monotonic() + 30
        while True:  # counters arrive with the core's periodic stats
            text = httpx.get(server.url + "/metrics").text
            drafts = metric_value(text, "pagedllm:spec_decode_num_draft_tokens_total")
            if drafts or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        accepted = metric_value(text, "pagedllm:spec_decode_num_accepted_tokens_total")
        assert drafts and drafts > 0 and accepted is not None and 0 < accepted <= drafts
        pos0 = metric_value(text, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"})
        assert pos0 is not None and pos0 > 0
        deadline = time.monotonic() + 15
        while "spec decode acceptance rate" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "spec decode acceptance rate" in server.log()
    finally:
        server.stop()  # exit codes on shutdown are tested in tests/entrypoints


def test_bad_speculative_configs_are_refused_clearly(tiny_llama_dir):
    with pytest.raises(ValueError, match="method"):
        LLM(tiny_llama_dir, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "foo": 1})
    with pytest.raises(ValueError, match="exactly one of"):
        LLM(tiny_llama_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_layers=5"):
        LLM(tiny_llama_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                "draft_layers": 5}, kv_cache_memory_bytes="8MiB")


def test_beam_search_with_speculation_is_refused(tiny_llama_dir):
    from pagedllm.engine.beam_search import BeamSearchParams

    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="8MiB",
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="beam search is not supported with speculative decoding"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=4))
