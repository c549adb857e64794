"""The fast attention path against the reference one, on a mixed batch through block tables."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.layouts import CONTIGUOUS_SLOTS
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.ops import write_kv
from pagedllm.attention.torch_backend import CompiledBackend, TorchBackend
from pagedllm.attention.registry import select_backend
from pagedllm.config import AttentionConfig
from pagedllm.kernels import paged_attention_ops
from tests.attention_utils import backend_attention, reference_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HKV, GROUP = 2, 3


def _metadata(computed: list[int], query_lens: list[int]) -> AttentionMetadata:
    """Scatter each request's blocks over the pool in a shuffled order (non-contiguous)."""
    gen = torch.Generator().manual_seed(0)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    seq_lens = [c + q for c, q in zip(computed, query_lens)]
    max_blocks = max(-(-s // BLOCK_SIZE) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    slots = []
    for i, (c, s) in enumerate(zip(computed, seq_lens)):
        n = -(-s // BLOCK_SIZE)
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        slots += [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl,
        seq_lens_list=seq_lens,
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
        block_size=BLOCK_SIZE,
    )
    return md


# Three decodes (long, short, one-token context), then a first prefill, a later chunk, and
# short runs after a context (speculative verification). All runs short: every row a decode
# of its own context, in one kernel call (compiled); with a long chunk: the short runs in one
# padded call, the chunks one call each.
STEPS = {
    "short-runs": ([17, 3, 0, 0, 9, 21, 2, 6], [1, 1, 1, 7, 6, 5, 3, 2]),
    "with-long-chunk": ([17, 3, 0, 0, 9, 21, 2, 6], [1, 1, 1, 7, 20, 5, 3, 2]),
}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-kernel", "torch-ops"])
@pytest.mark.parametrize("sliding_window", [None, 5])
# 64: the default model's head size (the kernel's AVX2 paths for both passes); 40: its AVX2
# scores with the generic weighted sum; 12: the generic kernel throughout.
@pytest.mark.parametrize("D", [64, 40, 12])
@pytest.mark.parametrize("step", list(STEPS))
def test_torch_attention_matches_reference(sliding_window, compiled, D, step):
    config = AttentionConfig(compiled_kernels=compiled)
    if compiled:
        assert paged_attention_ops() is not None, "the compiled kernel must build here"
    torch.manual_seed(0)
    computed, query_lens = STEPS[step]
    md = _metadata(computed, query_lens)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    # Earlier context: random K/V at the already-computed positions.
    num_tokens = sum(query_lens)
    for i, c in enumerate(computed):
        for p in range(c):
            slot = int(md.block_tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            cache.view(2, -1, HKV, D)[:, slot] = torch.randn(2, HKV, D)
    q = torch.randn(num_tokens, HKV * GROUP, D)
    k = torch.randn(num_tokens, HKV, D)
    v = torch.randn(num_tokens, HKV, D)
    write_kv(cache, k, v, md.slot_mapping)
    ref = reference_attention(q, cache, md, 0.3, sliding_window)
    fast = backend_attention(config, q, k, v, cache, md, 0.3, sliding_window)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    # Soft-capped scores: every path applies the cap.
    ref = reference_attention(q, cache, md, 0.3, sliding_window, logit_soft_cap=2.0)
    fast = backend_attention(config, q, k, v, cache, md, 0.3, sliding_window, logit_soft_cap=2.0)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_row_decodes_give_each_row_its_context() -> None:
    # Requests: a decode at position 17, a run of 5 rows at positions 9..13, a first chunk of 3.
    md = _metadata([17, 9, 0], [1, 5, 3])
    rows = md.row_decodes
    assert rows.seq_lens_list == [18, 10, 11, 12, 13, 14, 1, 2, 3]
    assert rows.seq_lens.tolist() == rows.seq_lens_list
    assert rows.num_decodes == rows.num_reqs == 9 and rows.query_start_loc == list(range(10))
    assert torch.equal(rows.block_tables, md.block_tables[[0, 1, 1, 1, 1, 1, 2, 2, 2]])
    assert rows.slot_mapping is md.slot_mapping and md.row_decodes is rows  # built once per step
    decodes = _metadata([4, 7], [1, 1])
    assert decodes.row_decodes is decodes


@pytest.mark.parametrize("decode", ["kernel", "torch"])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("D", [64, 12])
def test_vattention_layout_matches_reference(sliding_window, decode, D):
    """The vattention layout [2, num_slots, capacity, Hkv, D]: each request reads its slot's
    contiguous slice (no block table), decodes through the contiguous kernel or per-request
    SDPA over views."""
    config = AttentionConfig(contiguous_decode=decode)
    if decode == "kernel":
        assert paged_attention_ops() is not None, "the compiled kernel must build here"
    torch.manual_seed(0)
    num_slots, capacity = 6, 32
    computed = [17, 3, 0, 0, 9]
    query_lens = [1, 1, 1, 7, 6]
    slots = [4, 0, 5, 2, 1]  # not in request order
    seq_lens = [c + q for c, q in zip(computed, query_lens)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    cache = torch.zeros(2, num_slots, capacity, HKV, D)
    for slot, c in zip(slots, computed):
        cache[:, slot, :c] = torch.randn(2, c, HKV, D)
    mapping = [s * capacity + p for s, c, n in zip(slots, computed, query_lens) for p in range(c, c + n)]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(mapping),
        block_tables=torch.zeros((0, 0), dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl,
        seq_lens_list=seq_lens,
        num_decodes=3,
        block_size=1,
        slots=torch.tensor(slots),
        slots_list=slots,
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, HKV * GROUP, D)
    k = torch.randn(num_tokens, HKV, D)
    v = torch.randn(num_tokens, HKV, D)
    write_kv(cache, k, v, md.slot_mapping)
    assert torch.equal(cache[0, 5, 0], k[2]), "a token is written at its position in its slot"
    ref = reference_attention(q, cache, md, 0.3, sliding_window, layout=CONTIGUOUS_SLOTS)
    fast = backend_attention(config, q, k, v, cache, md, 0.3, sliding_window, layout=CONTIGUOUS_SLOTS)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
