"""EngineCore: the step loop of scheduler and model runner (in process for the LLM class)."""

from __future__ import annotations

import logging

from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and fold the sampled tokens back into the requests."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
