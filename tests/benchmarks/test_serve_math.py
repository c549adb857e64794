"""`pagedllm bench serve`'s arithmetic and datasets on known inputs (no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm.benchmarks.serve import format_summary, namespace
from pagedllm.benchmarks.serve_datasets import DATASETS, DatasetContext, SampleRequest
from pagedllm.benchmarks.serve_metrics import (
    RequestResult, arrival_times, parse_goodput, parse_percentiles, summarize,
)


def results() -> list[RequestResult]:
    # TPOTs: (0.5-0.1)/2 = 0.2, (1.1-0.3)/4 = 0.2, none for one token; a failure.
    return [
        RequestResult(prompt_len=10, success=True, output_tokens=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2], start_time=0.0),
        RequestResult(prompt_len=20, success=True, output_tokens=5, ttft=0.3, latency=1.1, itl=[0.1, 0.2, 0.2, 0.3],
                      start_time=0.2),
        RequestResult(prompt_len=7, success=True, output_tokens=1, ttft=0.9, latency=0.9, start_time=1.5),
        RequestResult(prompt_len=5, success=False, error="HTTP 500"),
    ]


def test_summary_fields_and_percentiles():
    s = summarize(results(), duration=2.0, percentiles=[50.0, 90.0, 99.9])
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 37 and s["total_output_tokens"] == 9
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5
    assert s["total_token_throughput"] == 23.0 and s["request_goodput"] is None
    ttfts = np.array([100.0, 300.0, 900.0])
    assert s["mean_ttft_ms"] == pytest.approx(ttfts.mean()) and s["median_ttft_ms"] == pytest.approx(300.0)
    assert s["std_ttft_ms"] == pytest.approx(ttfts.std())
    # numpy's linear interpolation: p90 of (100, 300, 900) = 300 + 0.8 * 600.
    assert s["p90_ttft_ms"] == pytest.approx(780.0) and s["p50_ttft_ms"] == pytest.approx(300.0)
    assert s["p99.9_ttft_ms"] == pytest.approx(300 + 0.998 * 600)
    assert s["mean_tpot_ms"] == pytest.approx(200.0) and s["std_tpot_ms"] == pytest.approx(0.0)
    itls = np.array([0.2, 0.2, 0.1, 0.2, 0.2, 0.3]) * 1000
    assert s["mean_itl_ms"] == pytest.approx(itls.mean()) and s["p90_itl_ms"] == pytest.approx(np.percentile(itls, 90))
    assert s["median_e2el_ms"] == pytest.approx(900.0)
    # Requests overlap as [0, 0.5) and [0.2, 1.3); the third starts at 1.5 alone.
    assert s["max_concurrent_requests"] == 2
    text = format_summary(s | {"percentile_metrics": ["ttft", "e2el"], "max_concurrency": None})
    assert "P90 TTFT (ms):" in text and "Median E2EL (ms):" in text and "P99.9 TTFT (ms):" in text
    assert "TPOT" not in text


def test_peak_tokens_per_second():
    # Token times: request 0 at 0.1, 0.3, 0.5; request 1 at 0.5, 0.6, 0.8, 1.0, 1.3; request 2
    # at 2.4: second 0 holds six tokens (1.0 falls in second 1).
    s = summarize(results(), duration=2.0)
    assert s["max_output_tokens_per_s"] == 6


def test_goodput_counts_requests_within_every_objective():
    rs = results()
    # TTFT <= 300 ms: the first two; TPOT <= 200 ms: all three (one token counts as 0).
    assert summarize(rs, 2.0, goodput=parse_goodput(["ttft:300", "tpot:200"]))["request_goodput"] == 1.0
    # And E2EL <= 1000 ms: the first alone.
    assert summarize(rs, 2.0, goodput=parse_goodput(["ttft:300", "e2el:1000"]))["request_goodput"] == 0.5
    assert summarize(rs, 2.0, goodput={"tpot": 199.0})["request_goodput"] == 0.5  # the one-token request
    for bad in (["itl:5"], ["ttft=5"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError):
        parse_percentiles("50,101")


def test_arrivals_gamma_burstiness():
    rng = np.random.default_rng(0)
    assert not arrival_times(5, float("inf"), 1.0, rng).any()
    steady = arrival_times(4, 2.0, float("inf"), rng)
    assert steady == pytest.approx([0.5, 1.0, 1.5, 2.0])
    # Scaled so the last request leaves at n / rate; the gaps' spread falls as burstiness rises.
    cv = {}
    for b in (0.25, 1.0, 4.0):
        t = arrival_times(4000, 10.0, b, np.random.default_rng(1))
        assert t[-1] == pytest.approx(400.0) and np.all(np.diff(t) >= 0)
        gaps = np.diff(t)
        cv[b] = gaps.std() / gaps.mean()
    # A gamma's coefficient of variation is 1/sqrt(shape): 2, 1, 0.5.
    assert cv[0.25] == pytest.approx(2.0, rel=0.1) and cv[1.0] == pytest.approx(1.0, rel=0.1)
    assert cv[4.0] == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, 0.0, rng)


class WordTokenizer:
    """One token per whitespace-separated word (ids from a table), for the file datasets."""

    vocab_size = 1000
    special_ids: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self.words: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.words.setdefault(w, 100 + len(self.words)) for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        inverse = {v: k for k, v in self.words.items()}
        return " ".join(inverse.get(t, f"w{t}") for t in token_ids)

    def chat_prompt(self, content: str) -> str:
        return f"<user> {content} <assistant>"


def context(as_text: bool = False, **overrides) -> DatasetContext:
    tok = WordTokenizer()
    return DatasetContext(namespace(**overrides), lambda: tok, as_text, 1000)


def test_random_dataset_lengths_and_prefix():
    ctx = context(num_prompts=50, random_input_len=20, random_output_len=10, random_range_ratio=0.5,
                  random_prefix_len=4)
    samples = DATASETS["random"](ctx)
    assert len(samples) == 50
    assert {tuple(s.prompt[:4]) for s in samples} == {tuple(samples[0].prompt[:4])}  # one shared prefix
    assert all(4 + 10 <= s.prompt_len <= 4 + 30 and s.prompt_len == len(s.prompt) for s in samples)
    assert all(5 <= s.expected_output_len <= 15 for s in samples)
    assert len({s.prompt_len for s in samples}) > 5 and len({s.expected_output_len for s in samples}) > 3
    assert all(100 <= t < 1000 for s in samples for t in s.prompt)
    # The part after the prefix is a run of consecutive ids (mod the allowed range).
    body = samples[0].prompt[4:]
    assert all((b - a) % 900 == 1 for a, b in zip(body, body[1:]))
    assert DATASETS["random"](ctx)[3].prompt == samples[3].prompt  # seeded
    with pytest.raises(ValueError):
        DATASETS["random"](context(random_range_ratio=1.0))


def test_prefix_repetition_dataset():
    ctx = context(num_prompts=7, prefix_repetition_prefix_len=5, prefix_repetition_suffix_len=3,
                  prefix_repetition_num_prefixes=3, prefix_repetition_output_len=9)
    samples = DATASETS["prefix_repetition"](ctx)
    assert len(samples) == 6  # 7 // 3 = 2 prompts per prefix
    assert all(s.prompt_len == 8 and s.expected_output_len == 9 for s in samples)
    prefixes = [tuple(s.prompt[:5]) for s in samples]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [2, 2, 2]
    with pytest.raises(ValueError):
        DATASETS["prefix_repetition"](context(num_prompts=2, prefix_repetition_num_prefixes=3))


def test_chat_backend_gets_text():
    ctx = context(as_text=True, num_prompts=3, random_input_len=6, random_output_len=2)
    samples = DATASETS["random"](ctx)
    assert all(isinstance(s.prompt, str) and s.prompt_len == 6 for s in samples)


def test_sharegpt_filters_and_oversamples(tmp_path):
    def conv(human: int, gpt: int) -> dict:
        return {"conversations": [{"from": "human", "value": " ".join(f"h{i}" for i in range(human))},
                                  {"from": "gpt", "value": " ".join(f"g{i}" for i in range(gpt))}]}

    rows = [conv(5, 6), conv(3, 9), conv(8, 2), conv(1100, 10), conv(1000, 1100), conv(12, 7),
            {"conversations": [{"from": "human", "value": "alone"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    samples = DATASETS["sharegpt"](context(dataset_name="sharegpt", dataset_path=str(path), num_prompts=5))
    # Usable: (5, 6) and (12, 7); then oversampled to 5.
    assert len(samples) == 5 and {(s.prompt_len, s.expected_output_len) for s in samples} == {(5, 6), (12, 7)}
    few = DATASETS["sharegpt"](context(dataset_name="sharegpt", dataset_path=str(path), num_prompts=5, no_oversample=True))
    assert len(few) == 2
    fixed = DATASETS["sharegpt"](context(dataset_name="sharegpt", dataset_path=str(path), num_prompts=20,
                                         sharegpt_output_len=4, no_oversample=True))
    assert len(fixed) == 6 and all(s.expected_output_len == 4 for s in fixed)  # no length filter


def test_custom_jsonl_and_template(tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["one two", "three four five"]) + "\n")
    samples = DATASETS["custom"](context(dataset_name="custom", dataset_path=str(path), num_prompts=2,
                                         custom_output_len=7))
    assert sorted(s.prompt for s in samples) == ["<user> one two <assistant>", "<user> three four five <assistant>"]
    assert sorted(s.prompt_len for s in samples) == [4, 5] and all(s.expected_output_len == 7 for s in samples)
    raw = DATASETS["custom"](context(dataset_name="custom", dataset_path=str(path), num_prompts=2,
                                     skip_chat_template=True))
    assert sorted(s.prompt for s in raw) == ["one two", "three four five"]
    chat = DATASETS["custom"](context(as_text=True, dataset_name="custom", dataset_path=str(path), num_prompts=2))
    assert all(isinstance(s, SampleRequest) and "<user>" not in s.prompt for s in chat)  # the server templates
    with pytest.raises(ValueError):
        DATASETS["custom"](context(dataset_name="custom", num_prompts=2))  # no --dataset-path


def test_vllm_command_line_parses():
    from pagedllm.entrypoints.cli import build_parser

    argv = ("bench serve --backend openai-chat --host 127.0.0.1 --port 8001 --model m --dataset-name sharegpt "
            "--dataset-path d.json --num-prompts 10 --num-warmups 2 --percentile-metrics ttft,e2el "
            "--metric-percentiles 50,99 --goodput ttft:500 tpot:50 --burstiness 0.5 --request-rate 4 "
            "--random-prefix-len 8 --random-input-len 32 --random-output-len 8 --random-range-ratio 0.1 "
            "--prefix-repetition-prefix-len 64 --prefix-repetition-suffix-len 8 --prefix-repetition-num-prefixes 2 "
            "--prefix-repetition-output-len 4 --max-concurrency 4 --ignore-eos --temperature 0.7 --top-k 5 "
            "--save-result --result-filename r.json --disable-tqdm --seed 3").split()
    args = build_parser().parse_args(argv)
    assert args.backend == "openai-chat" and args.goodput == ["ttft:500", "tpot:50"] and args.num_warmups == 2
    assert args.burstiness == 0.5 and args.top_k == 5 and args.temperature == 0.7 and args.random_prefix_len == 8
    serve = build_parser().parse_args(["serve", "--metrics-names", "vllm"])
    assert serve.metrics_names == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-names", "prometheus"])


def test_local_tokenizer_by_pagedllm_model_name(default_tokenizer):
    from pagedllm.benchmarks.serve_datasets import to_text
    from pagedllm.benchmarks.serve_tokenizer import LocalTokenizer
    from pagedllm.engine.arg_utils import DEFAULT_MODEL

    tok = LocalTokenizer(DEFAULT_MODEL)
    assert tok.vocab_size == default_tokenizer.vocab_size and default_tokenizer.eos_token_id in tok.special_ids
    assert tok.encode("Hello world") == default_tokenizer.encode("Hello world", add_special_tokens=False)
    assert "Hello" in tok.chat_prompt("Hello") and tok.chat_prompt("Hello") != "Hello"
    text, n = to_text(tok, list(range(1000, 1040)))
    assert n == len(tok.encode(text)) <= 40
