"""``GET /health`` (open even with an API key) and ``GET /metrics`` (Prometheus text format)."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from ditattn.server.metrics import CONTENT_TYPE
from ditattn.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    return {"status": "ok", "model": state.runner.model_id, "queue_depth": state.scheduler.queue_depth,
            "attention_backends": state.runner.default_backends()}


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
