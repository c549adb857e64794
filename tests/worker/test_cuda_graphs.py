"""The CUDA-graph decode path's logic on the CPU (worker/cuda_graphs.py): the size ladder,
padding up to a captured size, the static buffers, and a padded replay of a tiny Llama's
decode step through the Triton backend (interpreted) equal to the eager forward, with the
padding rows writing nothing. ``eager_capture`` stands in for ``torch.cuda.graph``: it
re-runs the captured function over the same buffers, which is what a replay must compute;
the capture itself is checked on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import AttentionConfig
from pagedllm.attention.layouts import BLOCK_TABLES
from pagedllm.attention.metadata import forward_context
from pagedllm.attention.registry import bind_backend
from pagedllm.worker.cuda_graphs import DecodeBuffers, DecodeGraphs, default_capture_sizes, eager_capture, padded_size
from pagedllm.kv_backends.paged.worker import attention_layers
from tests.kernels.interpreter import import_interpreted, interpreter  # noqa: F401 (fixture)
from tests.models.utils import RequestState, bind_kv_caches, make_metadata

INTERPRETED = import_interpreted()
BLOCK_SIZE = 4


def test_capture_size_ladder():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize("rows, size", [(1, 1), (3, 4), (4, 4), (5, 8), (8, 8), (9, None)])
def test_padded_size(rows, size):
    assert padded_size(rows, [1, 2, 4, 8]) == size


def test_fill_pads_rows():
    buffers = DecodeBuffers.allocate(8, 5, torch.device("cpu"))
    buffers.block_tables.fill_(7)  # stale ids of an earlier, larger batch
    req_a = RequestState(list(range(10)), [3, 4, 9], num_computed_tokens=9)
    req_b = RequestState(list(range(6)), [5, 6], num_computed_tokens=5)
    md, ids, pos = make_metadata([(req_a, 1), (req_b, 1)], BLOCK_SIZE)
    buffers.fill(ids, pos, md, 4)
    assert buffers.input_ids[:4].tolist() == [9, 5, 0, 0]
    assert buffers.positions[:4].tolist() == [9, 5, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [9 * BLOCK_SIZE + 1, 6 * BLOCK_SIZE + 1, -1, -1]
    assert buffers.seq_lens[:4].tolist() == [10, 6, 1, 1]
    assert buffers.block_tables[:2, :3].tolist() == [[3, 4, 9], [5, 6, 0]]
    assert buffers.block_tables[2:4, 0].tolist() == [0, 0]  # padding rows read the null block
    md4 = buffers.metadata(4, BLOCK_SIZE)
    assert md4.num_reqs == md4.num_decodes == 4 and md4.query_start_loc_tensor.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.usefixtures("interpreter")
def test_padded_replay_equals_eager(tiny_llama_dir):
    from pagedllm.models.loader import load_model

    assert INTERPRETED
    model = load_model(tiny_llama_dir, dtype="float32", max_model_len=64).model
    bind_backend(attention_layers(model), AttentionConfig(backend="triton"), BLOCK_TABLES, "cpu")
    caches = bind_kv_caches(model, num_blocks=24, block_size=BLOCK_SIZE)
    reqs = [
        RequestState(list(range(100, 111)), [2, 7, 3]),
        RequestState(list(range(200, 206)), [5, 9]),
        RequestState(list(range(300, 314)), [11, 12, 13, 14]),
    ]
    with torch.inference_mode():
        md, ids, pos = make_metadata([(r, len(r.token_ids) - 1) for r in reqs], BLOCK_SIZE)
        with forward_context(md):
            model(ids, pos)  # prefill all but each prompt's last token
        for r in reqs:
            r.num_computed_tokens = len(r.token_ids) - 1
        md, ids, pos = make_metadata([(r, 1) for r in reqs], BLOCK_SIZE)
        graphs = DecodeGraphs(model, [1, 2, 4], max_blocks_per_seq=16, block_size=BLOCK_SIZE,
                              device=torch.device("cpu"), capture=eager_capture)
        graphs.capture_all()  # the warm-ups and captures of padding-only batches write nothing
        before = [c.clone() for c in caches]
        got = graphs.run(ids, pos, md)  # 3 rows replayed at the captured size 4
        assert got is not None and got.shape[0] == 3
        after = [c.clone() for c in caches]
        with forward_context(md):
            want = model(ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written = md.slot_mapping.tolist()
    for b, a in zip(before, after):
        changed = (b != a).reshape(2, -1, b.shape[-2] * b.shape[-1]).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= set(written)  # the replay wrote the real rows' slots only
        assert not a[:, 0].any()  # the null block stays zero
    # Steps the graphs do not take run eagerly: a prefill chunk among the rows, more rows
    # than the largest size.
    chunk = RequestState(list(range(8)), [15, 16], num_computed_tokens=4)
    mixed_md, mixed_ids, mixed_pos = make_metadata([(reqs[0], 1), (chunk, 3)], BLOCK_SIZE)
    assert graphs.run(mixed_ids, mixed_pos, mixed_md) is None
    small = DecodeGraphs(model, [1, 2], 16, BLOCK_SIZE, torch.device("cpu"), eager_capture)
    assert small.run(ids, pos, md) is None
