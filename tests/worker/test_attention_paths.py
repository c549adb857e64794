"""Every attention path on every KV backend against the reference attention.

The metadata comes from each backend's worker side (``KVCacheWorker.attention_metadata``)
over its own cache tensors, and the layer runs end to end (write, then attend), with the
fast implementations (the compiled decode kernels; torch ops alone; on the paged backend the
Triton kernels, interpreted) and with the float64 reference. Paths: decodes, a prompt's first
chunk, continuation chunks, two or more short continuation runs in one step (batched into
one padded call), and speculative verification (k + 1 query tokens after a context, next to
decodes); each plain, windowed, soft-capped.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import AttentionConfig
from pagedllm.kv_backends.vattention.worker import VAttentionKVCache
from pagedllm.attention.metadata import forward_context
from pagedllm.attention.ops import write_kv
from pagedllm.attention.registry import bind_backend
from pagedllm.layers.attention import Attention
from pagedllm.kernels import paged_attention_ops
from pagedllm.kv_backends.paged.worker import PagedKVWorker
from pagedllm.worker.kv_worker import KVCacheWorker, StepIndex
from tests.kernels.interpreter import import_interpreted, interpreter  # noqa: F401 (fixture)

INTERPRETED = import_interpreted()
pytestmark = pytest.mark.usefixtures("interpreter")

HKV, GROUP, D = 2, 3, 64
BLOCK_SIZE, NUM_BLOCKS = 4, 96
NUM_SLOTS = 8
SCALE = D**-0.5

# path -> (tokens already computed, tokens this step) per request; decodes come first.
PATHS = {
    "decode": ([17, 3, 0, 30], [1, 1, 1, 1]),
    "first_chunk": ([0, 0], [7, 12]),
    "continuation": ([9, 20], [6, 30]),
    "short_runs": ([9, 21, 2], [5, 3, 2]),
    "spec_verify": ([12, 10, 12, 31], [1, 1, 4, 4]),  # two decodes, two requests with k = 3 drafts
}
# The soft-cap (Gemma 2's attention logit soft-capping) at 2.0 bites: the scaled scores of these
# random q, k spread over about +-3, where 2 * tanh(s / 2) is well below s.
VARIANTS = {
    "full": {},
    "window": {"sliding_window": 5},
    "soft_cap": {"logit_soft_cap": 2.0},
    "soft_cap_window": {"logit_soft_cap": 2.0, "sliding_window": 5},
}
# The fast implementations: the compiled decode kernels, and torch ops alone (their fallbacks).
FAST = {"kernels": AttentionConfig(), "torch_ops": AttentionConfig(compiled_kernels=False)}


def _worker(backend: str, layer: Attention) -> KVCacheWorker:
    if backend == "paged":
        return PagedKVWorker([layer], NUM_BLOCKS, BLOCK_SIZE, "float32")
    # One slot's K (or V) must span whole 2 MiB: 4096 tokens of 2 x 64 float32 values.
    return VAttentionKVCache([layer], NUM_SLOTS, 4096, "float32")


def _block_ids(backend: str, seq_lens: list[int]) -> list[list[list[int]]]:
    """Each request's ids, scattered over the cache (not in request order)."""
    gen = torch.Generator().manual_seed(1)
    if backend == "paged":
        free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
        return [[[free.pop() for _ in range(-(-s // BLOCK_SIZE))]] for s in seq_lens]
    slots = torch.randperm(NUM_SLOTS, generator=gen).tolist()
    return [[[slots[i]]] for i in range(len(seq_lens))]


def _step(computed: list[int], counts: list[int]) -> StepIndex:
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, counts)])
    req_of_token = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    seq_lens = [c + n for c, n in zip(computed, counts)]
    query_start = [0]
    for n in counts:
        query_start.append(query_start[-1] + n)
    num_decodes = next((i for i, n in enumerate(counts) if n != 1), len(counts))
    return StepIndex(positions, req_of_token, torch.tensor(seq_lens), query_start, seq_lens, num_decodes)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("backend", ["paged", "vattention"])
def test_path_matches_reference(backend: str, path: str, variant: str) -> None:
    assert paged_attention_ops() is not None, "the compiled decode kernels must build here"
    torch.manual_seed(0)
    computed, counts = PATHS[path]
    layer = Attention(HKV * GROUP, D, HKV, SCALE, **VARIANTS[variant])
    worker = _worker(backend, layer)
    block_ids = _block_ids(backend, [c + n for c, n in zip(computed, counts)])
    # The earlier context: random K/V written at the computed positions through the backend.
    if any(computed):
        rows = [i for i, c in enumerate(computed) if c]
        context = _step([0] * len(rows), [computed[i] for i in rows])
        md = worker.attention_metadata([block_ids[i] for i in rows], context)
        num_context = sum(computed)
        write_kv(layer.kv_cache, torch.randn(num_context, HKV, D), torch.randn(num_context, HKV, D), md.slot_mapping)
    md = worker.attention_metadata(block_ids, _step(computed, counts))
    num_tokens = sum(counts)
    q = torch.randn(num_tokens, HKV * GROUP * D)
    k = torch.randn(num_tokens, HKV * D)
    v = torch.randn(num_tokens, HKV * D)
    outs = {}
    fast = dict(FAST, triton=AttentionConfig(backend="triton")) if backend == "paged" else FAST
    if backend == "paged":
        assert INTERPRETED
    for impl, config in {**fast, "reference": AttentionConfig(backend="reference")}.items():
        bind_backend([layer], config, worker.layout, "cpu")
        with forward_context(md):
            outs[impl] = layer(q, k, v)  # rewrites the same K/V at the same slots
    for impl in fast:
        torch.testing.assert_close(outs[impl], outs["reference"], atol=1e-5, rtol=1e-5, msg=impl)
    if "logit_soft_cap" in VARIANTS[variant]:  # negative control: the cap changes the output
        bind_backend([layer], AttentionConfig(backend="reference"), worker.layout, "cpu")
        layer.logit_soft_cap = None
        with forward_context(md):
            assert (layer(q, k, v) - outs["reference"]).abs().max() > 1e-2
    # The step's K landed where the backend's metadata says, for the last request's last token.
    flat = layer.kv_cache.view(2, -1, HKV, D)
    torch.testing.assert_close(flat[0, md.slot_mapping[-1]], k[-1].view(HKV, D))
