"""Every Triton kernel (pagedllm/kernels/triton/) against the float64 reference attention and
the torch formulations of the layer ops: in CI under Triton's interpreter on CPU tensors;
with PAGEDLLM_TEST_DEVICE=cuda compiled, on the GPU (scripts/gpu_check.sh).

On the CPU, TRITON_INTERPRET=1 is set around the first import of triton and of the kernels,
and while this module's tests run, and restored after each (tests/kernels/interpreter.py).
Float32 throughout; the kernels' ``tl.dot`` takes ``input_precision="ieee"`` for float32 (no
TF32), so the tolerances are float32 rounding. Shapes are tiny: the interpreter runs every
program instance in numpy.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.interpreter import import_interpreted, interpreter, interpreter_env  # noqa: F401

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")
_TRITON_IMPORTED_BEFORE = "triton" in sys.modules
INTERPRETED = import_interpreted() if DEVICE == "cpu" else False
_ENV_AFTER = os.environ.get("TRITON_INTERPRET")

from pagedllm.kernels.elementwise import _rms, _rotate  # noqa: E402
from pagedllm.kernels.triton import triton_ops  # noqa: E402
from pagedllm.kernels.triton.attention import _paged_attention_kernel, _write_kv_kernel  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.ops import write_kv  # noqa: E402
from tests.attention_utils import reference_attention  # noqa: E402

if DEVICE == "cpu":
    pytestmark = pytest.mark.usefixtures("interpreter")

HKV, D = 2, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 40
SCALE = D**-0.5


def ops():
    assert INTERPRETED or DEVICE != "cpu", (
        "triton was imported before this module without TRITON_INTERPRET=1 "
        f"(imported earlier: {_TRITON_IMPORTED_BEFORE}); the kernels cannot run on CPU tensors"
    )
    return triton_ops(DEVICE)


def dev(*tensors: torch.Tensor):
    """The tensors on the kernels' device (the references stay on the CPU)."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved if len(moved) > 1 else moved[0]


def test_interpreter_env_does_not_leak() -> None:
    assert _ENV_AFTER == _ENV_BEFORE  # restored after the import (and after this module)
    assert INTERPRETED == (DEVICE == "cpu")


def _metadata(computed: list[int], counts: list[int], holes: int = 0) -> AttentionMetadata:
    """Requests with ``computed`` cached tokens and ``counts`` new ones, their blocks drawn
    at random from the pool; the first ``holes`` blocks of every table are the null block 0
    (a sliding-window group freed them: only positions outside the window lived there)."""
    gen = torch.Generator().manual_seed(1)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    seq_lens = [c + n for c, n in zip(computed, counts)]
    max_blocks = max(-(-s // BLOCK_SIZE) for s in seq_lens) + 1  # one spare column of padding
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    for i, s in enumerate(seq_lens):
        n = -(-s // BLOCK_SIZE)
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        tables[i, : min(holes, n - 1)] = 0
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    slots = []
    for i, (c, n) in enumerate(zip(computed, counts)):
        for pos in range(c, c + n):
            slots.append(int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_decodes = next((i for i, n in enumerate(counts) if n != 1), len(counts))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        query_start_loc=starts,
        seq_lens_list=seq_lens,
        num_decodes=num_decodes,
        block_size=BLOCK_SIZE,
        query_start_loc_tensor=torch.tensor(starts, dtype=torch.int64),
        max_query_len=max(counts),
    )


# case -> (cached tokens, new tokens) per request (decodes first), group size, window, cap, holes
CASES = {
    "decode_gqa": ([17, 3, 0, 30], [1, 1, 1, 1], 3, None, 0.0, 0),
    "decode_mha_window": ([17, 3, 30], [1, 1, 1], 1, 5, 0.0, 0),
    "first_chunks_ragged": ([0, 0], [7, 12], 2, None, 0.0, 0),
    "continuation_softcap": ([9, 20], [6, 3], 3, None, 2.0, 0),
    "mixed_window_holes": ([22, 26, 18], [1, 1, 6], 2, 6, 0.0, 3),
    "mixed_window_softcap": ([13, 0, 9], [1, 5, 4], 4, 3, 5.0, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case: str) -> None:
    computed, counts, group, window, cap, holes = CASES[case]
    md = _metadata(computed, counts, holes)
    torch.manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    cache[:, 0] = 0.0  # the null block
    q = torch.randn(md.query_start_loc[-1], HKV * group, D)
    got = ops().paged_attention(
        *dev(q, cache, md.block_tables, md.seq_lens, md.query_start_loc_tensor), md.max_query_len, SCALE,
        sliding_window=window, softcap=cap,
    ).cpu()
    want = reference_attention(q, cache, md, SCALE, window, cap or None)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_paged_attention_tiles_and_int32_tables() -> None:
    # Query runs spanning several BLOCK_Q tiles and key tiles, with an int32 block table.
    md = _metadata([5, 0], [9, 11])
    group = 3
    torch.manual_seed(2)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    q = torch.randn(md.query_start_loc[-1], HKV * group, D)
    got = ops().paged_attention(
        *dev(q, cache, md.block_tables.to(torch.int32), md.seq_lens, md.query_start_loc_tensor),
        md.max_query_len, SCALE, block_q=16, block_n=16,
    ).cpu()
    torch.testing.assert_close(got, reference_attention(q, cache, md, SCALE, None), rtol=2e-5, atol=2e-5)


def test_write_kv_matches_torch_and_skips_padding() -> None:
    torch.manual_seed(3)
    k, v = torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    slots = torch.tensor([7, 0, 33, -1, 120], dtype=torch.int64)  # row 3: a padding row
    got = dev(torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D))
    ops().write_kv(got, *dev(k, v, slots))
    got = got.cpu()
    want = torch.zeros_like(got)
    keep = slots >= 0
    write_kv(want, k[keep], v[keep], slots[keep])
    assert torch.equal(got, want)


def test_kv_offsets_are_int64_past_2_pow_31() -> None:
    # A pool of 2^22 blocks of 16 tokens x 8 KV heads x 128 dims: 2^36 elements per half,
    # never allocated; the offsets of its top blocks are what the kernels compute (int32 ids
    # and offsets in, as a block table of int32 would give them).
    stride_slot = 8 * 128
    stride_block = 16 * stride_slot
    block_ids = torch.tensor([1, 2**17, 2**22 - 1, 2**22 - 2], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 15, 7], dtype=torch.int32)
    got = ops().kv_offsets(*dev(block_ids, offsets), stride_block, stride_slot).cpu()
    want = [int(b) * stride_block + int(o) * stride_slot for b, o in zip(block_ids, offsets)]
    assert got.dtype == torch.int64 and got.tolist() == want
    assert max(want) > 2**31  # the shapes do reach past int32 ...
    wrapped = (block_ids * stride_block + offsets * stride_slot).tolist()  # ... where int32 wraps
    assert wrapped != want


def test_kernels_address_the_pool_through_kv_offset() -> None:
    # The attention and KV-write kernels form cache addresses with kv_offset (the int64
    # helper checked above), not with a product of their own.
    for kernel in (_paged_attention_kernel, _write_kv_kernel):
        source = inspect.getsource(kernel.fn)
        assert "kv_offset(" in source and "* stride_c_block" not in source, kernel.__name__


def test_rms_norm_and_residual_add() -> None:
    torch.manual_seed(4)
    x, r, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(ops().rms_norm(*dev(x, w), 1e-6).cpu(), _rms(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    normed, summed = (t.cpu() for t in ops().add_rms_norm(*dev(x, r, w), 1e-6))
    assert torch.equal(summed, x + r)
    torch.testing.assert_close(normed, _rms(x + r, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_silu_and_mul() -> None:
    torch.manual_seed(5)
    x = torch.randn(3, 2 * 24)
    torch.testing.assert_close(ops().silu_and_mul(dev(x)).cpu(), F.silu(x[:, :24]) * x[:, 24:], rtol=1e-6, atol=1e-6)


def test_rotary_on_strided_views() -> None:
    torch.manual_seed(6)
    head_dim, hq = 8, 3
    cos_sin = torch.randn(50, head_dim)
    positions = torch.tensor([3, 7, 49, 0])
    qkv = torch.randn(4, (hq + 2 * HKV) * head_dim)
    q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim : (hq + HKV) * head_dim]  # row-strided views
    got_q, got_k = (t.cpu() for t in ops().rotary_embedding(dev(positions), *dev(q, k), dev(cos_sin)))
    cos, sin = cos_sin[positions][:, None, :].chunk(2, dim=-1)
    torch.testing.assert_close(got_q, _rotate(q, cos, sin, head_dim), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, _rotate(k, cos, sin, head_dim), rtol=1e-6, atol=1e-6)


def test_bfloat16_attention_and_layer_ops() -> None:
    # bfloat16 caches and activations: loads, conversions and stores in bfloat16, within a
    # bfloat16 step of the references. The interpreter rounds float32 -> bfloat16 toward zero
    # (the GPU to nearest) and misreads bfloat16 tl.dot operands, so the kernel runs its
    # products in float32 there; compiled, it uses bfloat16 dots.
    md = _metadata([13, 0, 9], [1, 5, 4])
    torch.manual_seed(7)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D).bfloat16()
    cache[:, 0] = 0.0
    q = torch.randn(md.query_start_loc[-1], HKV * 2, D).bfloat16()
    got = ops().paged_attention(
        *dev(q, cache, md.block_tables, md.seq_lens, md.query_start_loc_tensor), md.max_query_len, SCALE,
        sliding_window=3,
    ).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_attention(q, cache, md, SCALE, 3).float(), rtol=2e-2, atol=2e-2)
    x, r, w = torch.randn(3, 40).bfloat16(), torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    normed, summed = (t.cpu() for t in ops().add_rms_norm(*dev(x, r, w), 1e-6))
    torch.testing.assert_close(summed, x + r, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(normed, _rms(x + r, w, 1e-6), rtol=1.6e-2, atol=1e-2)
    g = torch.randn(3, 48).bfloat16()
    torch.testing.assert_close(ops().silu_and_mul(dev(g)).cpu(), F.silu(g[:, :24]) * g[:, 24:], rtol=1.6e-2, atol=1e-2)
