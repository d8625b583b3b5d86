"""The engine's state for operators: ``/v1/engine/state`` (a snapshot), its SSE stream, and ``/dashboard``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedllm.entrypoints.openai.common import JSONBodyRoute
from pagedllm.entrypoints.openai.dashboard import EngineStateHub, dashboard_html
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.state import ServerState, ServerStateDep

router = APIRouter(route_class=JSONBodyRoute)


async def take_state(state: ServerState, check: bool = False) -> dict:
    def take(e: Any) -> dict:  # on the engine thread, between two steps
        state.metrics.engine_state_snapshots.inc()
        return {**e.core.snapshot(check=check), **state.metrics.recent(), "model": state.served_model_name}

    return await state.engine().call(take)  # pooling models too


def engine_state_hub(state: ServerState, interval: float) -> EngineStateHub:
    """The hub that feeds every /v1/engine/state/stream watcher from one snapshot per interval."""
    return EngineStateHub(lambda: take_state(state), interval)


@router.get("/v1/engine/state", response_model=None)
async def engine_state(state: ServerStateDep, check: bool = False):
    """A snapshot of the engine (taken between two steps): KV block map, queues, the last steps' batches,
    the latest latencies and running totals; ``?check=true`` also checks the block pool's invariants."""
    return await take_state(state, check)


@router.get(
    "/v1/engine/state/stream",
    response_model=None,
    responses={200: {"description": "Server-Sent Events: one snapshot each", "content": {"text/event-stream": {}}}},
)
async def engine_state_stream(state: ServerStateDep):
    """The same snapshot as Server-Sent Events, one per interval, shared by every watcher."""
    state.engine()  # 503 while loading
    hub = state.hub
    assert hub is not None  # build_app sets it before serving
    if hub.closed:
        raise APIError(503, "the server is shutting down", "server_overloaded")
    if hub.full:
        raise APIError(
            503,
            f"{hub.max_watchers} clients already watch the engine state",
            "server_overloaded",
            headers={"Retry-After": "5"},
        )
    return StreamingResponse(
        hub.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


@router.get("/dashboard", response_model=None, response_class=HTMLResponse)
async def dashboard():
    """The live dashboard (its data comes from /v1/engine/state/stream, behind the API key)."""

    return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})
