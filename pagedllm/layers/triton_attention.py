"""The "triton" attention implementation: this step's K/V written by the Triton KV-write
kernel, then one paged-attention launch for the whole flat batch (decodes, first chunks and
continuation chunks alike), over the block-table layout (kernels/triton/attention.py).

It reads only device tensors and host ints from the metadata, so a step on CUDA makes no
host sync here; on CPU tensors the kernels run in Triton's interpreter (tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.kernels.triton import triton_ops

if TYPE_CHECKING:  # layers/attention.py imports this module when a layer first runs
    from pagedllm.layers.attention import AttentionMetadata


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (written here); kv_cache: [2, num_blocks, block_size,
    Hkv, D] -> [T, H, D]. ``logit_soft_cap`` c bounds each score to c * tanh(s / c)."""
    if md.slots is not None:
        raise ValueError("attention_backend='triton' reads block tables; the contiguous-slot layout needs 'torch'")
    ops = triton_ops(q.device)
    ops.write_kv(kv_cache, k, v, md.slot_mapping)
    query_start = md.query_start_loc_tensor
    if query_start is None:
        query_start = torch.tensor(md.query_start_loc, dtype=torch.int64, device=q.device)
    max_query_len = md.max_query_len
    if max_query_len is None:
        starts = md.query_start_loc
        max_query_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    return ops.paged_attention(
        q, kv_cache, md.block_tables, md.seq_lens, query_start, max_query_len, scale,
        sliding_window=sliding_window, softcap=logit_soft_cap or 0.0,
    )
