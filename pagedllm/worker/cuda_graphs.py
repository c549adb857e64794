"""CUDA graphs for decode steps: the model's forward captured once per batch size, replayed
with the step's inputs copied into static buffers and the batch padded up to a captured size.

Why it is sound: in a decode step every request has one query token, so a batch of B rows
has fixed shapes (input ids, positions, slot mapping, sequence lengths: [B]; block tables:
[B, max_blocks_per_seq]; query starts: 0..B), and the "triton" attention backend reads only
those device tensors plus host values that are the same for every decode batch of B rows
(B itself, max_query_len = 1). The Triton launches and cuBLAS calls recorded at capture
therefore read whatever the buffers hold at replay.

Padding rows (a batch of n < B rows replayed as B): token 0 at position 0, slot -1 (the KV
write kernel skips negative slots, so no cache is touched), one context token read through
the null block 0; their outputs are dropped. A block-table row is copied only up to the
step's width: the kernel reads no column past ``ceil(seq_len / block_size)``.

The capture itself is behind ``GraphCapture`` (``cuda_graph_capture`` on a GPU;
``eager_capture`` re-runs the function, so the padding and buffer logic is tested on CPU).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata, forward_context

GraphCapture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]
"""fn -> (fn's output as a static tensor, replay): replay() recomputes that output in place."""


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then multiples of 8, up to max_num_seqs (and it, last)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding ``num_rows`` (``sizes`` ascending); None past the
    largest (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def cuda_graph_capture(pool: object | None = None, warmups: int = 2) -> GraphCapture:
    """Capture into CUDA graphs sharing one memory pool (the caller captures largest first).
    Each function first runs ``warmups`` times on a side stream, as torch.cuda.graph asks:
    kernels compile and lazy allocations (cuBLAS workspaces) happen outside the capture."""
    shared = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared):
            out = fn()
        return out, graph.replay

    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """A stand-in without CUDA: replay re-runs ``fn`` over the same buffers into the same output."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return out, replay


@dataclass
class DecodeBuffers:
    """Static inputs of the largest captured batch; a batch of B rows uses views [:B]."""

    input_ids: torch.Tensor  # [B_max] int64
    positions: torch.Tensor  # [B_max] int64
    slot_mapping: torch.Tensor  # [B_max] int64, -1 on padding rows
    block_tables: torch.Tensor  # [B_max, max_blocks_per_seq] int64
    seq_lens: torch.Tensor  # [B_max] int64
    query_start_loc: torch.Tensor  # [B_max + 1] int64, 0..B_max (one query token per row)

    @classmethod
    def allocate(cls, max_rows: int, max_blocks_per_seq: int, device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            input_ids=zeros(max_rows), positions=zeros(max_rows),
            slot_mapping=torch.full((max_rows,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(max_rows, max_blocks_per_seq), seq_lens=torch.ones(max_rows, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(max_rows + 1, dtype=torch.int64, device=device),
        )

    def metadata(self, size: int, block_size: int) -> AttentionMetadata:
        """A decode batch of ``size`` rows over views of the buffers (its host fields are the
        same for every such batch)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens_list=[1] * size,  # read by no graphed backend (the triton one reads seq_lens)
            num_decodes=size,
            block_size=block_size,
            query_start_loc_tensor=self.query_start_loc[: size + 1],
            max_query_len=1,
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, size: int) -> None:
        """Copy a step's n decode rows into [:n] and pad rows n..size (see the module docstring)."""
        n = input_ids.shape[0]
        width = md.block_tables.shape[1]
        assert n <= size and width <= self.block_tables.shape[1], (n, size, width)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        if n < size:
            self.input_ids[n:size] = 0
            self.positions[n:size] = 0
            self.slot_mapping[n:size] = -1
            self.seq_lens[n:size] = 1
            self.block_tables[n:size, 0] = 0


class DecodeGraphs:
    """Captured decode forwards of ``model`` for each of ``sizes`` rows; ``run`` replays the
    smallest that holds a step, or returns None for a step it does not take."""

    def __init__(
        self, model: nn.Module, sizes: Sequence[int], max_blocks_per_seq: int, block_size: int,
        device: torch.device, capture: GraphCapture,
    ) -> None:
        assert sizes and list(sizes) == sorted(set(sizes)) and sizes[0] >= 1, sizes
        # A module whose forward branches on its data (a MoE layer runs only the experts its
        # tokens chose) would be frozen at capture to that data's branch.
        frozen = sorted({type(m).__name__ for m in model.modules() if not getattr(m, "cuda_graph_safe", True)})
        if frozen:
            raise ValueError(
                f"CUDA graphs cannot capture {', '.join(frozen)} (its forward depends on the step's "
                "data, e.g. which experts are routed to); run without cuda_graph_sizes (--cuda-graph-sizes)"
            )
        self.model = model
        self.sizes = list(sizes)
        self.block_size = block_size
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, device)
        self._capture = capture
        self._graphs: dict[int, tuple[torch.Tensor, Callable[[], None]]] = {}

    def capture_all(self) -> None:
        """Capture every size, largest first (later, smaller graphs reuse its pool memory)."""
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(lambda size=size: self._forward(size))

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        with forward_context(b.metadata(size, self.block_size)):
            return self.model(b.input_ids[:size], b.positions[:size])

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata | list[AttentionMetadata]
    ) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a step of n decode rows through a graph, or None when
        the step is not all decodes, has several KV cache groups or is larger than every size."""
        if isinstance(md, list) or md.num_decodes != md.num_reqs:
            return None
        n = md.num_reqs
        size = padded_size(n, self.sizes)
        if size is None or md.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None
        if not self._graphs:
            self.capture_all()
        self.buffers.fill(input_ids, positions, md, size)
        out, replay = self._graphs[size]
        replay()
        return out[:n]
