"""The small-M GGUF kernels against memory bandwidth: `gguf_linear`'s compiled kernel
(`ops.linear`, csrc/gguf_matmul.h) on random but valid blocks of each --types entry, for each
--shapes entry (K->N: a [N, K] weight) at each --m, against a torch copy of the same bytes.

    pagedllm bench gguf-matmul [--types Q4_K,Q6_K,Q8_0] [--shapes 2048x8192,8192x2048,2048x128256]
        [--m 1] [--rounds 5] [--path int16,int8] [--checkout DIR ...]

Per case: median ms of a call over --rounds rounds (every case once per round, so a load from
other work spreads over all), the weight bytes it reads per second (GB/s), and that as a
fraction of the copy's read + write bytes per second (the bandwidth a large copy shows, as
`bench random-llama-1b` states it). With --checkout (repeatable) each round runs the cases
in a fresh process per checkout, alternated (its `pagedllm` on PYTHONPATH; this file runs
there by path, so a checkout without it works): a before/after side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

# Byte offsets of each type's fp16 scale fields in a block (the rest are code bytes).
_FP16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """[N, K] of random valid blocks (random codes; fp16 scales of magnitude 2^-8 .. 1)."""
    import torch

    from pagedllm.kernels.gguf_blocks import GGUF_BLOCK_GEOMETRY, GGUFBlocks

    rng = np.random.default_rng(seed)
    elems, nbytes = GGUF_BLOCK_GEOMETRY[type_name]
    blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":
        blocks[:, 0] = rng.integers(120, 133, size=blocks.shape[0])
    for off in _FP16_FIELDS.get(type_name, ()):
        mag = np.exp2(rng.uniform(-8, 0, size=blocks.shape[0])) * rng.choice([-1, 1], size=blocks.shape[0])
        blocks[:, off : off + 2] = mag.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return GGUFBlocks(torch.from_numpy(blocks.reshape(n, -1)), type_name, k)


def _cases(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.m.split(",")]
    return [(t, k, n, m) for t in args.types.split(",") for (k, n) in shapes for m in ms]


def _paths(args: argparse.Namespace) -> list[str]:
    """The kernels to run each case with, alternated ("" alone: the build's choice)."""
    return args.path.split(",") if args.path else [""]


def _copy_seconds(src, dst, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(args: argparse.Namespace) -> dict[str, object]:
    """One process: every case and the copy, `args.rounds` times round-robin; median seconds."""
    import torch

    from pagedllm.kernels.build import gguf_linear_ops

    ops = gguf_linear_ops()
    assert ops is not None, "the gguf_linear extension did not build"
    index = {name: i for i, name in enumerate(ops.type_names())}
    kernels = dict(zip(ops.type_names(), ops.small_m_kernels()))
    cases = _cases(args)
    # Enough copies of each weight that together they overflow the last-level cache, used in
    # turn: every call reads its weight from memory, as a model's layers do.
    weights = {}
    for t, k, n, _ in cases:
        if (t, k, n) not in weights:
            first = random_blocks(t, n, k, seed=k + n)
            weights[(t, k, n)] = [first] + [
                type(first)(first.data.clone(), t, k) for _ in range(int(args.cache_bytes // first.nbytes))
            ]
    gen = torch.Generator().manual_seed(0)
    xs = {(k, m): torch.randn(m, k, generator=gen) for (_, k, _, m) in cases}
    times: dict[str, list[float]] = {}
    copy_bytes = 1 << 30
    src = torch.ones(copy_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    paths = _paths(args)
    label = lambda t, k, n, m, p: f"{t} {k}x{n} m{m}" + (f" {p}" if p else "")  # noqa: E731
    for _ in range(args.rounds + 1):  # the first round warms up
        for t, k, n, m in cases:
            for path in paths:
                ws, x = weights[(t, k, n)], xs[(k, m)]
                reps = max(len(ws), int(args.min_bytes // ws[0].nbytes))
                start = time.perf_counter()
                for i in range(reps):
                    ops.linear(x, ws[i % len(ws)].data, index[t], path)
                times.setdefault(label(t, k, n, m, path), []).append((time.perf_counter() - start) / reps)
        times.setdefault("copy", []).append(_copy_seconds(src, dst, 3))
    nbytes = {label(t, k, n, m, p): weights[(t, k, n)][0].nbytes for (t, k, n, m) in cases for p in paths}
    return {
        "kernels": {t: kernels[t] for t in args.types.split(",")},
        "threads": torch.get_num_threads(),
        "copy_gbps": [2 * copy_bytes / v / 1e9 for v in times["copy"][1:]],
        "cases": {name: {"s": [float(v) for v in ts[1:]], "bytes": nbytes[name]}
                  for name, ts in times.items() if name != "copy"},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--shapes", default="2048x8192,8192x2048,2048x128256", help="K x N per case, comma-separated")
    parser.add_argument("--m", default="1", help="activation rows per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--path", default="",
                        help="the kernel ops.linear runs ('' the build's choice; int8, int16, float, fast), or "
                             "several comma-separated, alternated per case")
    parser.add_argument("--min-bytes", type=float, default=2e9, help="weight bytes read per timed sample at least")
    parser.add_argument("--cache-bytes", type=float, default=96e6,
                        help="distinct weight bytes per case at least (beyond the last-level cache)")
    parser.add_argument("--checkout", action="append", default=[], help="a checkout to run (repeatable)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def _report(label: str, result: dict[str, object]) -> None:
    copy = float(np.median(result["copy_gbps"]))  # type: ignore[arg-type]
    print(f"{label}: threads {result['threads']}, copy (read + write) {copy:.1f} GB/s, kernels {result['kernels']}")
    print(f"| case | weight MB | ms | GB/s | x copy |")
    print("| --- | --- | --- | --- | --- |")
    for name, c in result["cases"].items():  # type: ignore[union-attr]
        s = float(np.median(c["s"]))
        gbps = c["bytes"] / s / 1e9
        print(f"| {name} | {c['bytes'] / 1e6:.1f} | {s * 1e3:.3f} | {gbps:.1f} | {gbps / copy:.2f} |")


def run(args: argparse.Namespace) -> None:
    if not args.checkout:
        result = measure(args)
        if args.json:
            print("RESULT " + json.dumps(result))
        else:
            _report("this process", result)
        return
    # Alternate checkouts one round at a time, a fresh process each; merge their samples.
    merged: dict[str, dict[str, object]] = {}
    argv = [a for a in sys.argv[1:] if a not in ("bench", "gguf-matmul")]
    argv = [a for i, a in enumerate(argv) if a != "--checkout" and (i == 0 or argv[i - 1] != "--checkout")]
    for _ in range(args.rounds):
        for checkout in args.checkout:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--rounds", "1", "--json"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.split("RESULT ", 1)[1])
            into = merged.setdefault(checkout, result)
            if into is not result:
                into["copy_gbps"] += result["copy_gbps"]  # type: ignore[operator]
                for name, c in result["cases"].items():
                    into["cases"][name]["s"] += c["s"]  # type: ignore[index]
    for checkout, result in merged.items():
        _report(checkout, result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args())
