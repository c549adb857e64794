"""EngineCore: the step loop of scheduler and model runner (in process for the LLM class)."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv_connector: Any = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        # Disaggregated prefill: the KV connector's worker side (KVConnectorWorkerBase) or None.
        self.kv_connector = kv_connector

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and fold the sampled tokens back into the requests."""
        scheduler_output = self.scheduler.schedule()
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(scheduler_output.kv_connector_metadata)
        runner_output = self.runner.execute(scheduler_output)
        if self.kv_connector is not None:
            if scheduler_output.is_empty and self.scheduler.waiting_for_remote:
                self.kv_connector.wait_for_transfers(0.005)  # only pulls in flight: do not spin
            runner_output.kv_connector_output = self.kv_connector.get_finished()
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
