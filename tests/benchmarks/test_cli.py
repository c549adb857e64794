"""`pagedllm bench NAME`: every registered benchmark is a subcommand, cheap to build, and the
shared workloads and a folded-in script's search agree with the engine."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pagedllm.benchmarks import BENCHMARKS
from pagedllm.benchmarks.workloads import random_prompts, random_token_prompts
from pagedllm.entrypoints.cli import build_parser

# The flags each benchmark needs beyond its defaults.
_REQUIRED = {
    "disagg-itl": ["--base-url", "http://127.0.0.1:1"],
    "random-llama-1b": ["--out", "out", "--llama-cpp", "llama.cpp"],
}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_is_a_subcommand(name):
    module = importlib.import_module(f"pagedllm.benchmarks.{BENCHMARKS[name][0]}")
    args = build_parser().parse_args(["bench", name, *_REQUIRED.get(name, [])])
    assert args.bench_command == name and args.func is module.run
    assert module.__doc__  # shown by `pagedllm bench NAME --help`


def test_building_the_parser_imports_no_torch():
    # `pagedllm --help` and `pagedllm serve` build every bench parser first: keep it cheap.
    code = ("import sys; from pagedllm.entrypoints.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in BENCHMARKS)


def test_workloads_are_seeded_and_in_range():
    a = random_prompts(8, 5, 9, 1000, seed=3)
    assert a == random_prompts(8, 5, 9, 1000, seed=3) != random_prompts(8, 5, 9, 1000, seed=4)
    assert all(5 <= len(p) <= 9 and all(100 <= t < 1000 for t in p) for p in a)
    b = random_token_prompts(16, 20, 0.5, 1000, seed=0)
    assert all(10 <= len(p) <= 30 for p in b) and len({len(p) for p in b}) > 1
    assert {len(p) for p in random_token_prompts(4, 20, 0.0, 1000, seed=0)} == {20}


@pytest.mark.slow
def test_naive_beam_search_finds_the_engines_beams(tiny_llama_dir):
    # `bench beam-search` compares the engine with this outside loop: same beams, or the
    # throughput ratio compares different searches.
    from pagedllm import LLM, BeamSearchParams
    from pagedllm.benchmarks.beam_search import naive_beam_search

    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes="16MiB")
    prompt = random_prompts(1, 12, 12, 1000, seed=0)[0]
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=5))
    finished, num_beam_tokens = naive_beam_search(llm, prompt, 2, 5, 1.0)
    assert [s.tokens[len(prompt):] for s in out.sequences] == [t for _, t in finished]
    assert 5 <= num_beam_tokens <= 2 * 5
