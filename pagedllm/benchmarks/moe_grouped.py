"""One sparse MoE layer of Qwen3-30B-A3B's shape over GGUF-block experts: the grouped-expert
call against the per-expert loop (layers/moe.py), alternated, per step size.

    pagedllm bench moe-grouped [--types Q4_K:Q6_K Q8_0:Q8_0] [--tokens 1 4 16] [--rounds 5]

The layer: hidden 2048, 128 experts of intermediate 768, top-8 renormalised, the router
float32 N(0, 1) (so each step's tokens pick experts at random over the 128, as a trained
router's spread does); the experts random valid blocks of each `gate_up:down` type (the code
bytes random, the fp16 scales small). Per round, `--calls` forward calls of each path in turn
(the order reversing between rounds); reported: the median over rounds of ms per call and
its ratio to the grouped call's. `--quantized-weight-loop` adds the loop over the same bytes
as QuantizedWeight experts (Q4_0, Q4_1, Q8_0), the form the loader gave such experts before. The MoE block only: attention, norms and the head are not in it.

    pagedllm bench moe-grouped --model FILE.gguf [--output-len 32] [--rounds 5]

With `--model` (a GGUF file with sparse MoE layers), instead: the engine's single-stream decode
(quant_decode.single_stream_ms: one 32-token prompt, ms per output token after the first),
every sparse layer on the grouped call against every one on the loop, alternated per round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedllm.kernels.gguf_blocks import GGUFBlocks
    from pagedllm.layers.moe import SparseMoE

HIDDEN, NUM_EXPERTS, INTERMEDIATE, TOP_K = 2048, 128, 768, 8
# Byte offsets of the fp16 scales in a block of each type the benchmark writes.
_SCALE_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, n: int, k: int, rng: Any) -> GGUFBlocks:
    """[n, k] of random code bytes with fp16 scales of magnitude 1e-3 (rng: numpy's)."""
    import numpy as np
    import torch

    from pagedllm.kernels.gguf_blocks import GGUF_BLOCK_GEOMETRY, GGUFBlocks

    elems, nbytes = GGUF_BLOCK_GEOMETRY[type_name]
    blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    for off in _SCALE_FIELDS[type_name]:
        blocks[:, off : off + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    return GGUFBlocks(torch.from_numpy(blocks.reshape(n, -1)), type_name, k)


def make_layer(gate_up_type: str, down_type: str, seed: int = 0) -> SparseMoE:
    import numpy as np
    import torch

    from pagedllm.layers.moe import MoEConfig, SparseMoE

    rng = np.random.default_rng(seed)
    moe = SparseMoE(HIDDEN, MoEConfig(NUM_EXPERTS, TOP_K, INTERMEDIATE, norm_topk_prob=True))
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed)))
    for expert in moe.experts:
        for shard in (0, 1):
            gate_up = random_blocks(gate_up_type, INTERMEDIATE, HIDDEN, rng)
            expert.gate_up_proj.weight_loader(expert.gate_up_proj.weight, gate_up, shard)
        expert.down_proj.weight_loader(expert.down_proj.weight, random_blocks(down_type, HIDDEN, INTERMEDIATE, rng))
    moe.finish_loading()
    assert moe.expert_stacks is not None
    return moe


def quantized_weight_copy(gate_up_type: str, down_type: str) -> SparseMoE:
    """make_layer's layer (same seed, same bytes) with every expert as QuantizedWeight (Q4_0,
    Q4_1, Q8_0: how the loader kept a 3-D expert stack of these types before the grouped call),
    no stacks: the loop's other form."""
    from pagedllm.models.gguf_quant import gguf_quantized_weight

    moe = make_layer(gate_up_type, down_type)
    for expert in moe.experts:
        for linear in (expert.gate_up_proj, expert.down_proj):
            blocks = linear.blocks
            assert blocks is not None
            linear.quant = gguf_quantized_weight(blocks.data.numpy(), blocks.type_name, blocks.shape)
            linear.blocks = None
    moe.expert_stacks = None
    return moe


def ms_per_call(moe: SparseMoE, xs: list[torch.Tensor], grouped: bool) -> float:
    import torch

    moe.use_grouped = grouped
    with torch.inference_mode():
        start = time.perf_counter()
        for x in xs:
            moe(x)
        return (time.perf_counter() - start) / len(xs) * 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--types", nargs="+", default=["Q4_K:Q6_K", "Q8_0:Q8_0"], help="gate_up:down GGUF types")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16], help="tokens per step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="forward calls per path per round")
    parser.add_argument("--quantized-weight-loop", action="store_true",
                        help="also the loop over the same experts as QuantizedWeight (Q4_0, Q4_1, Q8_0 types)")
    parser.add_argument("--model", default=None, help="a GGUF file with MoE layers: engine single-stream decode")
    parser.add_argument("--output-len", type=int, default=32, help="with --model: tokens per timed request")


def run_model(args: argparse.Namespace) -> None:
    from pagedllm.benchmarks.quant_decode import single_stream_ms
    from pagedllm.benchmarks.workloads import random_prompts
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.layers.moe import SparseMoE

    llm = LLM(model=args.model, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
    moes = [m for m in llm.llm_engine.engine_core.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.expert_stacks is not None for m in moes), "no sparse layer with stacked GGUF experts"
    prompt = random_prompts(1, 32, 32, llm.llm_engine.model_config.vocab_size, seed=1)[0]
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for grouped in (True, False) if r % 2 == 0 else (False, True):
            for m in moes:
                m.use_grouped = grouped
            times[grouped].append(single_stream_ms(llm, prompt, args.output_len))
            print(f"round {r} {'grouped' if grouped else 'loop   '} {times[grouped][-1]:7.2f} ms/token", flush=True)
    g, loop = statistics.median(times[True]), statistics.median(times[False])
    print(f"{len(moes)} sparse layers  loop {1e3 / loop:6.2f} tok/s ({loop:.2f} ms)  grouped {1e3 / g:6.2f} tok/s "
          f"({g:.2f} ms)  grouped/loop {loop / g:5.2f}x", flush=True)


def run(args: argparse.Namespace) -> None:
    import torch

    if args.model is not None:
        run_model(args)
        return
    for types in args.types:
        gate_up_type, down_type = types.split(":")
        moe = make_layer(gate_up_type, down_type)
        # name -> (layer, use_grouped)
        paths = {"grouped": (moe, True), "loop": (moe, False)}
        if args.quantized_weight_loop and {gate_up_type, down_type} <= {"Q4_0", "Q4_1", "Q8_0"}:
            paths["loop over QuantizedWeight"] = (quantized_weight_copy(gate_up_type, down_type), False)
        for num_tokens in args.tokens:
            gen = torch.Generator().manual_seed(num_tokens)
            xs = [torch.randn(num_tokens, HIDDEN, generator=gen) for _ in range(args.calls)]
            for layer, grouped in paths.values():  # warm-up (and the build)
                ms_per_call(layer, xs[:1], grouped)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for r in range(args.rounds):
                for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
                    times[name].append(ms_per_call(*paths[name][:1], xs, paths[name][1]))
            g = statistics.median(times["grouped"])
            cells = [f"{name} {statistics.median(t):8.2f} ms ({statistics.median(t) / g:4.2f}x)" for name, t in times.items()]
            print(f"{types:10s} T={num_tokens:4d}  " + "  ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
