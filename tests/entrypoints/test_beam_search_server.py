"""use_beam_search=true through the server: the engine core runs the search over shared KV
blocks beside other requests; the beams equal the offline LLM.beam_search on the same model."""

from __future__ import annotations

import pytest

from pagedllm import BeamSearchParams
from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_metrics_disconnect import wait_all_blocks_free

PROMPT = "The three primary colors are"


@pytest.mark.slow
def test_beam_search_completion_equals_offline(server, client, default_llm):
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, n=3, extra_body={"use_beam_search": True}
    )
    (offline,) = default_llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=10))
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [s.text for s in offline.sequences]
    assert resp.usage.completion_tokens == sum(len(s.output_token_ids) for s in offline.sequences)

    # Streaming delivers the same beams (each as one chunk when the search ends).
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, n=3, stream=True, extra_body={"use_beam_search": True}
    )
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in resp.choices]

    # Beam blocks all come back.
    wait_all_blocks_free(server)


@pytest.mark.slow
def test_beam_search_chat_beside_sampling(client):
    """A beam search and ordinary requests at once: all finish."""
    import concurrent.futures

    def beam():
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, n=2,
            extra_body={"use_beam_search": True},
        )

    def plain(i):
        return client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=8, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        beam_future = pool.submit(beam)
        plain_futures = [pool.submit(plain, i) for i in range(3)]
        resp = beam_future.result()
        plains = [f.result() for f in plain_futures]
    assert len(resp.choices) == 2 and all(c.message.content for c in resp.choices)
    assert resp.choices[0].message.content != resp.choices[1].message.content
    assert all(p.choices[0].finish_reason == "length" for p in plains)
