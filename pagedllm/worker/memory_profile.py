"""The memory profile behind the CUDA KV budget from ``gpu_memory_utilization`` (vLLM's
meaning; the rule itself is platforms/cuda.py's ``kv_budget_from_utilization``).

The process may use ``utilization * total`` bytes of the device. The weights are loaded; one
forward pass at the step's largest shape (``max_num_batched_tokens`` tokens of prompts, then
logits and the sampler's sort at ``max_num_seqs`` rows) shows the activations' peak; the KV
pool gets what the peak leaves of the allowance. Memory outside torch's allocator (the CUDA
context, cuBLAS workspaces) counts against the allowance too.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.config import AttentionConfig, ModelConfig
from pagedllm.attention.metadata import forward_context
from pagedllm.attention.registry import bind_backend
from pagedllm.platforms.interface import MemoryProfile
from pagedllm.kv_backends.paged.worker import PagedKVWorker, attention_layers, kv_bytes_per_block, num_layer_slots
from pagedllm.worker.kv_worker import StepIndex

logger = logging.getLogger(__name__)


def profile_forward(
    model: nn.Module, model_config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
    block_size: int, attention_config: AttentionConfig, device: torch.device | str,
) -> int:
    """One forward of ``max_num_batched_tokens`` prompt tokens (prompts of at most
    max_model_len) over a KV pool just large enough for them, then the logits of
    ``max_num_seqs`` rows and their sort (top-p's worst case). Returns the bytes of that
    pool; the layers are left without a KV cache (the runner binds the real one)."""
    max_len = model_config.max_model_len
    lengths = [min(max_len, max_num_batched_tokens - start) for start in range(0, max_num_batched_tokens, max_len)]
    layers = attention_layers(model)
    blocks = [-(-n // block_size) for n in lengths]
    worker = PagedKVWorker(layers, sum(blocks) + 1, block_size, model_config.dtype, device)
    backend = bind_backend(layers, attention_config, worker.layout, device)
    block_ids, next_id = [], 1
    for n in blocks:
        block_ids.append([list(range(next_id, next_id + n))])
        next_id += n
    positions = torch.cat([torch.arange(n) for n in lengths])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    step = StepIndex(
        positions=positions,
        req_of_token=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        seq_lens=torch.tensor(lengths),
        query_start_loc=starts,
        seq_lens_list=lengths,
        num_decodes=0 if lengths[0] > 1 else len(lengths),
    )
    md = worker.attention_metadata(block_ids, step)
    md = [backend.prepare_metadata(m) for m in md] if isinstance(md, list) else backend.prepare_metadata(md)
    input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode(), forward_context(md):
        hidden = model(input_ids, positions.to(device))
        if hasattr(model, "compute_logits"):  # a pooling-only model has no LM head
            rows = min(max_num_seqs, max_num_batched_tokens)
            logits = model.compute_logits(hidden[:rows])  # type: ignore[operator]
            logits.sort(dim=-1, descending=True)
    for layer in layers:
        layer.kv_cache = None
    return kv_bytes_per_block(model_config, block_size, num_layer_slots(layers)) * (sum(blocks) + 1)


def profile_device_memory(
    model: nn.Module, model_config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
    block_size: int, attention_config: AttentionConfig, device: torch.device | str,
) -> MemoryProfile:
    """The device's total memory and the peak one profiled forward reaches (torch.cuda's
    allocator statistics: a CUDA device; the platform's budget rule calls it)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    pool_bytes = profile_forward(
        model, model_config, max_num_batched_tokens, max_num_seqs, block_size, attention_config, device
    )
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device) - pool_bytes + max(outside_torch, 0)
    torch.cuda.empty_cache()
    logger.info(
        "memory profile: %.0f MiB peak (weights, activations at %d tokens, %.0f MiB outside torch) "
        "of %.0f MiB", peak / 2**20, max_num_batched_tokens, outside_torch / 2**20, total / 2**20,
    )
    return MemoryProfile(total_bytes=total, peak_bytes=peak)
