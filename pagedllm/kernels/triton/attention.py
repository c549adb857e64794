"""Paged attention and the KV write in Triton, over the block-table layout.

KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at 0, V at 1);
a token's slot is ``block_id * block_size + offset``. Every index product that can address
the pool is computed in int64 (``kv_offset``): a pool of more than 2^31 elements (e.g. 30
layers' worth of blocks in one tensor, or one layer of a large model at 90% of an H200)
overflows int32 offsets at the top block ids.

One attention kernel serves decodes, prefill chunks and continuation chunks alike: a program
takes one request, one KV head and a tile of ``BLOCK_Q`` query rows, where row r is query
token ``r // GROUP`` with query head ``kv_head * GROUP + r % GROUP`` (GQA: the group's heads
share each K/V tile it loads), and runs an online softmax over its context in tiles of
``BLOCK_N`` keys read through the block table. Masking: key j is visible to the query at
position p when j <= p and, with a sliding window w, j > p - w.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention", "write_kv", "kv_offsets", "next_power_of_2"]


@triton.jit
def kv_offset(block_id, block_offset, stride_block, stride_slot):
    # Element offset of a slot in one of the cache's [num_blocks, block_size, ...] halves, in
    # int64 whatever the types of the ids and strides that come in.
    return block_id.to(tl.int64) * stride_block + block_offset.to(tl.int64) * stride_slot


@triton.jit
def _kv_offsets_kernel(out_ptr, block_ids_ptr, offsets_ptr, n, stride_block, stride_slot, BLOCK: tl.constexpr):
    # Exposes kv_offset to the tests: out[i] = offset of (block_ids[i], offsets[i]).
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    block_id = tl.load(block_ids_ptr + i, mask=mask, other=0)
    block_offset = tl.load(offsets_ptr + i, mask=mask, other=0)
    tl.store(out_ptr + i, kv_offset(block_id, block_offset, stride_block, stride_slot), mask=mask)


def kv_offsets(block_ids: torch.Tensor, offsets: torch.Tensor, stride_block: int, stride_slot: int) -> torch.Tensor:
    """[n] int64 element offsets of (block id, offset in block) pairs as the kernels compute
    them; block_ids, offsets: [n] int32 or int64."""
    n = block_ids.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=block_ids.device)
    block = 16
    _kv_offsets_kernel[(triton.cdiv(n, block),)](out, block_ids, offsets, n, stride_block, stride_slot, BLOCK=block)
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    # One program per token: its K and V rows [Hkv, D] into its slot; slot < 0 is a padding
    # row (a CUDA-graph batch padded to its captured size) and writes nothing.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HD)
    head = cols // HEAD_DIM
    d = cols % HEAD_DIM
    mask = (cols < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    dst = kv_offset(slot // BLOCK_SIZE, slot % BLOCK_SIZE, stride_c_block, stride_c_slot) + head * stride_c_head + d
    k = tl.load(k_ptr + t * stride_k_tok + head * stride_k_head + d, mask=mask)
    v = tl.load(v_ptr + t * stride_v_tok + head * stride_v_head + d, mask=mask)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_c_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, Hkv, D]; k, v: [T, Hkv, D]; slot_mapping: [T]
    int64 (negative: skip the row)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert kv_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, NUM_KV_HEADS=num_kv_heads,
        BLOCK_HD=next_power_of_2(num_kv_heads * head_dim),
    )


@triton.jit
def _tanh(x):
    # tanh from exp of a non-positive argument (no overflow): sign(x) (1 - e) / (1 + e),
    # e = exp(-2|x|).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, softcap, sliding_window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    stride_bt_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr,
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req).to(tl.int64)
    q_len = (tl.load(query_start_ptr + req + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)

    rows = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    tok = rows // GROUP  # query token of each row, within the request
    head = kv_head * GROUP + rows % GROUP
    row_valid = tok < q_len
    q_pos = seq_len - q_len + tok  # [BLOCK_Q] position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_rows = (q_start + tok) * stride_q_tok + head.to(tl.int64) * stride_q_head  # [BLOCK_Q] int64
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last row's position, from its first row's window.
    last_tok = tl.minimum((q_tile + 1) * BLOCK_Q - 1, q_len * GROUP - 1) // GROUP
    hi = seq_len - q_len + last_tok + 1
    lo = hi * 0  # an int32 scalar like hi (the loop's carried type)
    if USE_WINDOW:
        first_tok = (q_tile * BLOCK_Q) // GROUP
        lo = tl.maximum(seq_len - q_len + first_tok - sliding_window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    has_rows = (q_tile * BLOCK_Q < q_len * GROUP).to(tl.int32)
    hi = lo + (hi - lo) * has_rows  # a tile past the request's queries reads no keys

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    table = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    # A while loop, not range(lo, hi): Triton 3.6's interpreter cannot take a tensor loop
    # bound under numpy 2 (it converts the bound with int() of a 1-element array).
    start = lo
    while start < hi:
        k_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_valid = k_pos < hi
        block_id = tl.load(table + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        offsets = kv_offset(block_id, k_pos % BLOCK_SIZE, stride_c_block, stride_c_slot)  # [BLOCK_N] int64
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(k_base + stride_c_kv + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:  # IEEE float32 products, no TF32
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_Q, BLOCK_N]
        else:  # bfloat16 products into float32 sums
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        start += BLOCK_N
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + tok) * stride_o_tok + head.to(tl.int64) * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :])


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
"""Decorated under TRITON_INTERPRET=1: the kernels run in the interpreter, on CPU tensors."""


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    block_q: int | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """Attention of a flat batch over the paged cache (this step's K/V already written).

    q: [T, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; block_tables: [R, max_blocks]
    int32/int64; seq_lens: [R] (context including this step's tokens); query_start_loc:
    [R + 1] (device tensors); max_query_len: the longest query run (a host int, so the launch
    needs no device read). softcap c > 0 bounds scores to c * tanh(s / c); 0 is off.
    Returns [T, H, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, (num_heads, num_kv_heads)
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    out = torch.empty_like(q)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    rows = max_query_len * group
    if block_q is None:  # tl.dot needs >= 16 rows; longer query runs take bigger tiles
        block_q = 16 if rows <= 16 else 64
    grid = (num_reqs, triton.cdiv(rows, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, kv_cache, block_tables, seq_lens, query_start_loc,
        float(scale), float(softcap), int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_Q=block_q, BLOCK_N=block_n,
        USE_SOFTCAP=softcap > 0, USE_WINDOW=sliding_window is not None,
        # The interpreter's tl.dot misreads bfloat16 operands (numpy has no bfloat16): there
        # bfloat16 runs its products in float32; compiled, it uses the bfloat16 tensor cores.
        FP32_DOT=q.dtype == torch.float32 or INTERPRETED,
    )
    return out
