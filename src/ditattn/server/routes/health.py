"""``GET /health`` (open even with an API key) and ``GET /metrics`` (Prometheus text format).

``/health`` says ``ok`` (idle), ``busy`` (a batch runs within its time), ``degraded`` (the running
batch is past its request timeout: stuck inside one step) or ``draining`` (shutting down), with the
running batch's age; the last two answer 503 so that a load balancer stops sending work.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from ditattn.server.metrics import CONTENT_TYPE
from ditattn.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    body, status = state.health()
    return JSONResponse(body, status_code=status)


@router.get("/metrics")
def metrics(state: ServerState = Depends(server_state)):  # sync: a replica's view reads the shared store
    return Response(state.render_metrics(), media_type=CONTENT_TYPE)
