"""``GET /dashboard`` (one self-contained HTML page) and ``GET /dashboard/state`` (its JSON).

The state joins the engine's KV snapshot (the KV backend's view: a block map, or reserved
and resident pages per request; and the queue figures, taken between steps and shared by
viewers for ``KV_SNAPSHOT_MAX_AGE_S``) with the front end's own records
(token rates, prefix-cache hit rate, TTFT and inter-token latency percentiles, time series).
The fields are documented in docs/dashboard.md.
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state

STATE_PATH = "/dashboard/state"
_PAGE = Path(__file__).with_name("dashboard.html")
router = APIRouter()


@lru_cache(maxsize=1)
def dashboard_html() -> str:
    return _PAGE.read_text(encoding="utf-8")


async def dashboard_state(engine: AsyncLLM) -> dict[str, Any]:
    snapshot, age = await engine.get_kv_snapshot()
    return {
        "time": time.time(),
        "model": engine.model_name,
        "kv": snapshot.kv.to_json(),
        "requests": {
            "running": snapshot.num_running,
            "waiting": snapshot.num_waiting,
            "preempted": snapshot.num_preempted,
            "preemptions_total": snapshot.num_preemptions_total,
        },
        "replicas": engine.replica_states(),
        **engine.metrics.history.summary(),
        "engine": {
            "snapshot_age_s": age,
            "snapshot_seconds": snapshot.take_seconds,
            "snapshot_cost_seconds_mean": snapshot.cost_seconds_mean,
            "step_seconds_mean": snapshot.step_seconds_mean,
        },
    }


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-store"})


@router.get(STATE_PATH)
async def dashboard_state_json(state: ServerState = Depends(server_state)) -> JSONResponse:
    return JSONResponse(await dashboard_state(state.engine), headers={"Cache-Control": "no-store"})
