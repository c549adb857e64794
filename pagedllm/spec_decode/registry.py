"""The proposer registry: ``SpeculativeConfig.method`` -> proposer."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_model import build_draft_proposer
from pagedllm.spec_decode.ngram import NgramRunnerProposer
from pagedllm.spec_decode.proposer import Proposer, RunnerView

PROPOSERS: dict[str, Callable[[SpeculativeConfig, RunnerView], Proposer]] = {
    "ngram": lambda config, runner: NgramRunnerProposer(config),
    "draft_model": build_draft_proposer,
}


def build_proposer(config: SpeculativeConfig, runner: RunnerView) -> Proposer:
    return PROPOSERS[config.method](config, runner)
