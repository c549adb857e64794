"""``GET /dashboard`` (one self-contained HTML page) and ``GET /dashboard/state`` (its JSON).

The state joins the engine's KV snapshot (block map and queue figures, taken between steps
and shared by viewers for ``KV_SNAPSHOT_MAX_AGE_S``) with the front end's own records
(token rates, prefix-cache hit rate, TTFT and inter-token latency percentiles, time series).
The fields are documented in the README ("Dashboard").
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from pagedllm.core.kv_snapshot import FREE, FREE_CACHED, IN_USE, IN_USE_CACHED, STATE_NAMES, KVSnapshot
from pagedllm.engine.async_llm import AsyncLLM

STATE_PATH = "/dashboard/state"
_PAGE = Path(__file__).with_name("dashboard.html")


@lru_cache(maxsize=1)
def dashboard_html() -> str:
    return _PAGE.read_text(encoding="utf-8")


def kv_state(snapshot: KVSnapshot) -> dict[str, Any]:
    """The block map and the KV figures, as plain JSON types."""
    state = snapshot.block_state
    counts = np.bincount(state, minlength=len(STATE_NAMES))
    num_usable = len(state) - 1
    num_in_use = int(counts[IN_USE] + counts[IN_USE_CACHED])
    allocated = snapshot.num_allocated_slots
    return {
        "num_blocks": len(state),
        "block_size": snapshot.block_size,
        "num_groups": snapshot.num_groups,
        "state_names": list(STATE_NAMES),
        "block_state": state.tolist(),
        "ref_cnt": snapshot.ref_cnt.tolist(),
        "owner": snapshot.owner.tolist(),
        "requests": snapshot.requests,
        "num_free": int(counts[FREE]),
        "num_free_cached": int(counts[FREE_CACHED]),
        "num_in_use": num_in_use,
        "num_in_use_cached": int(counts[IN_USE_CACHED]),
        "num_shared": int(np.count_nonzero(snapshot.ref_cnt > 1)),
        "usage": num_in_use / num_usable if num_usable else 0.0,
        "num_allocated_slots": allocated,
        "num_empty_slots": snapshot.num_empty_slots,
        "fragmentation": snapshot.num_empty_slots / allocated if allocated else 0.0,
        "backend": snapshot.extra,
    }


async def dashboard_state(engine: AsyncLLM) -> dict[str, Any]:
    snapshot, age = await engine.get_kv_snapshot()
    return {
        "time": time.time(),
        "model": engine.model_name,
        "kv": kv_state(snapshot),
        "requests": {
            "running": snapshot.num_running,
            "waiting": snapshot.num_waiting,
            "preempted": snapshot.num_preempted,
            "preemptions_total": snapshot.num_preemptions_total,
        },
        **engine.metrics.history.summary(),
        "engine": {
            "snapshot_age_s": age,
            "snapshot_seconds": snapshot.take_seconds,
            "snapshot_cost_seconds_mean": snapshot.cost_seconds_mean,
            "step_seconds_mean": snapshot.step_seconds_mean,
        },
    }


def add_dashboard_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-store"})

    @app.get(STATE_PATH)
    async def dashboard_state_json() -> JSONResponse:
        return JSONResponse(await dashboard_state(engine), headers={"Cache-Control": "no-store"})
