"""The engine's flags for commands outside entrypoints/ (the benchmarks): EngineArgs stays
the user-facing edge, and everything past it receives an EngineConfig or ``LLM`` keywords."""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import DEFAULT_MODEL, EngineArgs

__all__ = ["DEFAULT_MODEL", "add_engine_flags", "engine_config", "engine_kwargs"]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Every engine flag (generated from EngineArgs' fields), without the model positional."""
    EngineArgs.add_cli_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords the command line gave, with the defaults of the rest: ``LLM(**...)``."""
    return vars(EngineArgs.from_cli_args(args))


def engine_config(**kwargs: Any) -> EngineConfig:
    """The validated configuration of ``LLM``-style keywords."""
    return EngineArgs(**kwargs).create_engine_config()
