"""EngineCore: the step loop of scheduler and model runner (in process for the LLM class)."""

from __future__ import annotations

import logging

from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.beam_search import BeamSearchManager, BeamSearchParams
from pagedllm.request import Request, RequestStatus
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.beam_search = BeamSearchManager(scheduler, runner.eos_token_ids)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        """A beam search over shared KV blocks; its one output (``beams`` set) ends it."""
        self.beam_search.add(request_id, prompt_token_ids, params)

    def abort_requests(self, request_ids: list[str]) -> None:
        others = self.beam_search.abort(request_ids)
        self.scheduler.finish_requests(others, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.beam_search.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and fold the sampled tokens back into the requests."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self.beam_search.process(outputs)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
