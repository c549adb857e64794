"""``/v1/models``: the served names and the loaded LoRA adapters."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(server_state)) -> ModelList:
    engine = state.engine
    max_len = engine.model_config.max_model_len if engine.model_config is not None else None
    cards = [ModelCard(id=name, root=engine.args.model, max_model_len=max_len) for name in state.model_names]
    for adapter in state.loras.adapters() if state.loras is not None else ():
        cards.append(ModelCard(id=adapter.lora_name, root=adapter.lora_path, max_model_len=max_len,
                               parent=adapter.base_model_name or state.model_names[0]))
    return ModelList(data=cards)
