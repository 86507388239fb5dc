"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server runs."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from ditattn.server.protocol import ModelCard, ModelList, RequestError
from ditattn.server.state import ServerState, server_state

router = APIRouter()


def _card(state: ServerState) -> ModelCard:
    adapters = getattr(state.runner, "adapters", None)
    return ModelCard(
        id=state.runner.model_id,
        created=int(state.started),
        lora_adapters=adapters() if adapters else [],
        image_input=getattr(state.runner.defaults, "image_input", "none"),
    )


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(server_state)):
    return JSONResponse(ModelList(data=[_card(state)]).model_dump())


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: ServerState = Depends(server_state)):
    if model_id not in state.runner.aliases:
        raise RequestError(
            f"The model '{model_id}' does not exist on this server",
            status=404,
            type="not_found_error",
            code="model_not_found",
        )
    return JSONResponse(_card(state).model_dump())
