"""`pagedllm bench NAME ...`: one subcommand per module of BENCHMARKS."""

from __future__ import annotations

import argparse
import importlib

from pagedllm.benchmarks import BENCHMARKS


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (pagedllm bench NAME --help)", allow_abbrev=False)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="NAME")
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = importlib.import_module(f"pagedllm.benchmarks.{module_name}")
        parser = bench_sub.add_parser(
            name, help=help_text, description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        )
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
