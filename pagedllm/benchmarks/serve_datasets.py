"""`pagedllm bench serve --dataset-name NAME`: the workloads of `vllm bench serve`.

- ``random``: per request an input length uniform in ``[floor(L(1-r)), ceil(L(1+r))]`` and
  an output length likewise around ``--random-output-len`` (at least 1), ``L =
  --random-input-len``, ``r = --random-range-ratio`` in [0, 1); a ``--random-prefix-len``
  prefix of random tokens shared by every request goes in front. The rest is a run of
  consecutive token ids from a random offset, so requests share nothing beyond the prefix.
- ``prefix_repetition``: ``--prefix-repetition-num-prefixes`` random prefixes of
  ``-prefix-len`` tokens, each followed by ``num_prompts // num_prefixes`` random suffixes of
  ``-suffix-len`` tokens, shuffled; ``-output-len`` tokens each.
- ``sharegpt``: a ShareGPT JSON (or JSONL) file at ``--dataset-path``: the first human turn
  of each conversation with two turns or more is the prompt; the output length is the reply's
  token count (or ``--sharegpt-output-len``). Without a fixed output length, pairs shorter than
  4 tokens, prompts over 1024 and pairs over 2048 tokens are skipped, as vLLM does.
- ``custom``: a JSONL (or JSON list) file of ``{"prompt": ...}``, ``--custom-output-len``
  tokens each. For the completions backend the model's chat template goes around each prompt
  unless ``--skip-chat-template`` (the chat backend's server applies its own).

File datasets are shuffled with ``--seed`` and oversampled (random repeats) when they hold
fewer usable prompts than ``--num-prompts``, unless ``--no-oversample``.

Synthetic prompts are token ids; the completions backend sends them as such (exact lengths,
accepted by vLLM and pagedllm alike), the chat backend decodes them to text (re-encoded and
cut to the target length, so ``prompt_len`` counts what the server's tokenizer sees).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedllm.benchmarks.serve_tokenizer import FIRST_PLAIN_TOKEN_ID, BenchTokenizer

logger = logging.getLogger(__name__)

SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]
    """Text, or token ids (the completions backend sends synthetic prompts as ids)."""
    prompt_len: int
    expected_output_len: int


@dataclass(frozen=True)
class DatasetContext:
    args: argparse.Namespace
    tokenizer: Callable[[], BenchTokenizer]
    """Made on first use: the token-id datasets need none for the completions backend."""
    as_text: bool
    """The backend takes text only (chat)."""
    vocab_size: int


def plain_token_ids(vocab_size: int, special_ids: frozenset[int]) -> np.ndarray:
    ids = np.arange(FIRST_PLAIN_TOKEN_ID, vocab_size)
    return ids[~np.isin(ids, list(special_ids))] if special_ids else ids


def to_text(tokenizer: BenchTokenizer, token_ids: list[int]) -> tuple[str, int]:
    """Decode, re-encode and cut to the same length (a decode may re-encode to more tokens);
    the text and its token count."""
    text = tokenizer.decode(token_ids)
    again = tokenizer.encode(text)
    if len(again) > len(token_ids):
        again = again[: len(token_ids)]
        text = tokenizer.decode(again)
        again = tokenizer.encode(text)
    return text, len(again)


def _finish(ctx: DatasetContext, ids: list[int], output_len: int) -> SampleRequest:
    if not ctx.as_text:
        return SampleRequest(ids, len(ids), output_len)
    text, n = to_text(ctx.tokenizer(), ids)
    return SampleRequest(text, n, output_len)


def _length_range(mean: int, ratio: float) -> tuple[int, int]:
    return math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))


def sample_random(ctx: DatasetContext) -> list[SampleRequest]:
    a = ctx.args
    if not 0.0 <= a.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio {a.random_range_ratio} must be in [0, 1)")
    in_low, in_high = _length_range(a.random_input_len, a.random_range_ratio)
    out_low, out_high = _length_range(a.random_output_len, a.random_range_ratio)
    out_low, out_high = max(out_low, 1), max(out_high, 1)
    if a.random_prefix_len + in_low < 1:
        raise ValueError("--random-input-len is too small: a prompt would have no token")
    rng = np.random.default_rng(a.seed)
    allowed = plain_token_ids(ctx.vocab_size, _special_ids(ctx))
    n = a.num_prompts
    input_lens = rng.integers(in_low, in_high + 1, size=n)
    output_lens = rng.integers(out_low, out_high + 1, size=n)
    offsets = rng.integers(0, len(allowed), size=n)
    prefix = allowed[rng.integers(0, len(allowed), size=a.random_prefix_len)].tolist()
    return [
        _finish(ctx, prefix + allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist(),
                int(output_lens[i]))
        for i in range(n)
    ]


def sample_prefix_repetition(ctx: DatasetContext) -> list[SampleRequest]:
    a = ctx.args
    per_prefix = a.num_prompts // a.prefix_repetition_num_prefixes
    if per_prefix == 0:
        raise ValueError(
            f"--num-prompts {a.num_prompts} must be at least --prefix-repetition-num-prefixes "
            f"{a.prefix_repetition_num_prefixes}"
        )
    rng = np.random.default_rng(a.seed)
    allowed = plain_token_ids(ctx.vocab_size, _special_ids(ctx))
    requests = []
    for _ in range(a.prefix_repetition_num_prefixes):
        prefix = allowed[rng.integers(0, len(allowed), size=a.prefix_repetition_prefix_len)].tolist()
        for _ in range(per_prefix):
            suffix = allowed[rng.integers(0, len(allowed), size=a.prefix_repetition_suffix_len)].tolist()
            requests.append(_finish(ctx, prefix + suffix, a.prefix_repetition_output_len))
    random.Random(a.seed).shuffle(requests)
    return requests


def _special_ids(ctx: DatasetContext) -> frozenset[int]:
    """Ids to leave out of synthetic prompts: a local tokenizer's specials (the server's are
    not served: ids below FIRST_PLAIN_TOKEN_ID stay out either way)."""
    return ctx.tokenizer().special_ids if ctx.as_text or ctx.args.tokenizer else frozenset()


def load_records(path: str) -> list[dict]:
    """A JSON list, or JSON Lines (one object a line)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(stripped)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _take(ctx: DatasetContext, candidates: list, build: Callable[[object], SampleRequest | None]) -> list[SampleRequest]:
    """Shuffle, build until num_prompts usable ones; oversample if there are fewer."""
    a = ctx.args
    rnd = random.Random(a.seed)
    rnd.shuffle(candidates)
    out: list[SampleRequest] = []
    for item in candidates:
        if len(out) >= a.num_prompts:
            break
        sample = build(item)
        if sample is not None:
            out.append(sample)
    if not out:
        raise ValueError(f"{a.dataset_path} has no usable prompt")
    if len(out) < a.num_prompts and not a.no_oversample:
        logger.info("oversampling %d prompts to %d", len(out), a.num_prompts)
        out += [rnd.choice(out) for _ in range(a.num_prompts - len(out))]
    return out


def sample_sharegpt(ctx: DatasetContext) -> list[SampleRequest]:
    a = ctx.args
    tok = ctx.tokenizer()
    conversations = [
        c for c in (r.get("conversations") or r.get("conversation") for r in load_records(_path(a)))
        if c and len(c) >= 2
    ]

    def build(conv) -> SampleRequest | None:
        prompt = conv[0]["value"]
        prompt_len = len(tok.encode(prompt))
        fixed = a.sharegpt_output_len
        output_len = fixed if fixed is not None else len(tok.encode(conv[1]["value"]))
        if fixed is None and (prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN):
            return None
        if fixed is None and (prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN):
            return None
        return SampleRequest(prompt, prompt_len, output_len)

    return _take(ctx, conversations, build)


def sample_custom(ctx: DatasetContext) -> list[SampleRequest]:
    a = ctx.args
    tok = ctx.tokenizer()
    records = load_records(_path(a))
    if any("prompt" not in r for r in records):
        raise ValueError(f"{a.dataset_path}: every record needs a \"prompt\"")
    template = not (ctx.as_text or a.skip_chat_template)

    def build(record) -> SampleRequest:
        prompt = tok.chat_prompt(record["prompt"]) if template else record["prompt"]
        return SampleRequest(prompt, len(tok.encode(prompt)), a.custom_output_len)

    return _take(ctx, records, build)


def _path(args: argparse.Namespace) -> str:
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path (a local JSON or JSONL file)")
    return args.dataset_path


# --dataset-name -> sampler; "random" and "prefix_repetition" take no --dataset-path.
DATASETS: dict[str, Callable[[DatasetContext], list[SampleRequest]]] = {
    "random": sample_random,
    "prefix_repetition": sample_prefix_repetition,
    "sharegpt": sample_sharegpt,
    "custom": sample_custom,
}
SYNTHETIC_DATASETS = frozenset({"random", "prefix_repetition"})


def add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=list(DATASETS), default="random")
    p.add_argument("--dataset-path", default=None, help="sharegpt / custom: a local JSON or JSONL file")
    p.add_argument("--no-oversample", action="store_true",
                   help="do not repeat prompts when the file has fewer than --num-prompts")
    p.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send the prompts as they are (no chat template around them)")
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input and output lengths uniform in len*(1 +- ratio), ratio in [0, 1)")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random tokens in front of every prompt")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="default: each reply's length")
    p.add_argument("--custom-output-len", type=int, default=256)


def apply_length_overrides(args: argparse.Namespace) -> None:
    """--input-len / --output-len, vLLM's general lengths, over the dataset-specific ones."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
        args.prefix_repetition_output_len = args.output_len
        args.sharegpt_output_len = args.output_len
        args.custom_output_len = args.output_len
    if args.dataset_name in SYNTHETIC_DATASETS and args.dataset_path is not None:
        raise ValueError(f"--dataset-name {args.dataset_name} takes no --dataset-path")
