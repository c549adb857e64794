"""The Triton backend: this step's K/V written by the Triton KV-write kernel, then one
paged-attention launch for the whole flat batch (decodes, first chunks and continuation
chunks alike), over the block-table layout (kernels/triton/attention.py).

It reads only device tensors and host ints from the metadata, so a step on CUDA makes no
host sync here (its decode steps are CUDA-graph capturable); on CPU tensors the kernels run
in Triton's interpreter (tests).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.layouts import KVLayout
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton import triton_ops
from pagedllm.layers.kv_quant import quant_format


class TritonBackend(AttentionBackend):
    name = "triton"
    runs = frozenset({"sliding_window", "logit_soft_cap"})
    graph_capturable = True

    def __init__(self, layout: KVLayout) -> None:
        if not layout.has_block_tables:
            raise ValueError(
                f"attention backend 'triton' reads block tables; the {layout.name} layout needs 'torch'"
            )
        super().__init__(layout)

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """The launch's query starts as a device tensor and its longest run as a host int."""
        if md.query_start_loc_tensor is None:
            md.query_start_loc_tensor = torch.tensor(md.query_start_loc, dtype=torch.int64, device=md.seq_lens.device)
        if md.max_query_len is None:
            md.max_query_len = md.longest_query_run
        return md

    def write(self, kv_cache, k, v, md):
        assert quant_format(kv_cache) is None, "the Triton kernels read a float KV cache (EngineArgs refuses)"
        triton_ops(k.device).write_kv(kv_cache, k, v, md.slot_mapping)

    def attend(self, layer, q, k, v, md):
        # q: [T, H, D] -> [T, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        assert layer.kv_cache is not None
        md = self.prepare_metadata(md)  # callers that built metadata without the runner
        assert md.query_start_loc_tensor is not None and md.max_query_len is not None
        p = layer.params
        return triton_ops(q.device).paged_attention(
            q, layer.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc_tensor, md.max_query_len, p.scale,
            sliding_window=p.sliding_window, softcap=p.logit_soft_cap or 0.0,
        )
