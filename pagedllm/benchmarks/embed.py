"""`pagedllm bench embed`: embedding throughput (texts/s at a batch of N texts of L tokens)
and the p50 latency of one short text, optionally beside sentence-transformers on the same
checkpoint (its own tokenization of the same texts, decoded from the random ids, in the dtype
asked for; `--st-dtype bfloat16` is its fastest on a CPU with native bf16).

The texts are random token ids (vocabulary ids from 100 up), the same for every run; each
measurement follows a warm-up of the same shape. docs/pooling.md describes the engine path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

from pagedllm.entrypoints.engine_flags import DEFAULT_MODEL, add_engine_flags, engine_kwargs


@dataclass
class EmbedResult:
    engine: str
    num_texts: int
    input_len: int
    texts_per_s: float
    """num_texts x iterations / the iterations' wall time."""
    p50_short_ms: float
    """Median wall time of embedding one text of --short-len tokens alone."""

    def summary(self) -> str:
        return (f"{self.engine:<28} {self.texts_per_s:9.1f} texts/s at {self.num_texts} x {self.input_len} tokens, "
                f"p50 {self.p50_short_ms:7.2f} ms for one short text")


def _timed(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure(embed, batch, short, iters: int, short_iters: int, engine: str, input_len: int) -> EmbedResult:
    """``embed(list)`` timed over ``batch`` (after one warm-up) and over ``short`` alone."""
    embed(batch)
    embed(short)
    batch_times = _timed(lambda: embed(batch), iters)
    short_times = _timed(lambda: embed(short), short_iters)
    return EmbedResult(engine, len(batch), input_len, len(batch) * iters / sum(batch_times),
                       1000 * statistics.median(short_times))


def _random_texts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random ids clear of the low ids (special tokens), tiny vocabularies included."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(min(100, vocab // 2), vocab, size=(num, length)).tolist()


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    vocab = llm.llm_engine.model_config.vocab_size
    seed = args.seed or 0
    batch = _random_texts(args.num_texts, args.input_len, vocab, seed)
    short = _random_texts(1, args.short_len, vocab, seed + 1)
    results = [measure(lambda ids: llm.embed(ids), batch, short, args.num_iters, args.short_iters,
                       "pagedllm", args.input_len)]
    if args.sentence_transformers:
        results.append(_sentence_transformers(llm, batch, short, args))
    for r in results:
        print(r.summary())
    if len(results) == 2:
        print(f"pagedllm / sentence-transformers: {results[0].texts_per_s / results[1].texts_per_s:.2f}x texts/s")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


def _sentence_transformers(llm, batch, short, args: argparse.Namespace) -> EmbedResult:
    import torch
    from sentence_transformers import SentenceTransformer

    tokenizer = llm.get_tokenizer()
    texts = tokenizer.batch_decode(batch, skip_special_tokens=True)
    short_texts = tokenizer.batch_decode(short, skip_special_tokens=True)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.st_dtype]
    st = SentenceTransformer(llm.llm_engine.model_dir, device="cpu", model_kwargs={"dtype": dtype})
    return measure(lambda t: st.encode(t, batch_size=len(t)), texts, short_texts, args.num_iters,
                   args.short_iters, f"sentence-transformers {args.st_dtype}", args.input_len)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    add_engine_flags(parser)
    parser.add_argument("--num-texts", type=int, default=32, help="texts per timed batch")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per text")
    parser.add_argument("--num-iters", type=int, default=3, help="timed batches")
    parser.add_argument("--short-len", type=int, default=16, help="tokens of the one short text")
    parser.add_argument("--short-iters", type=int, default=20, help="timed runs of the short text")
    parser.add_argument("--sentence-transformers", action="store_true",
                        help="also time sentence-transformers on the same checkpoint directory")
    parser.add_argument("--st-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--save-json", default=None)
