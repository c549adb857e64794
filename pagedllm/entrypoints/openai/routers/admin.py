"""Operator routes: ``/reset_prefix_cache`` (``router``, included only in dev mode:
VLLM_SERVER_DEV_MODE=1, as vLLM), and loading or unloading LoRA adapters at run
time (``lora_router``, included only with --enable-lora and runtime updating allowed)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_base import OpenAIError, bad_request

logger = logging.getLogger(__name__)
router = APIRouter()
lora_router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: ServerState = Depends(server_state)) -> dict:
    return {"reset": await state.engine.reset_prefix_cache()}


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: ServerState = Depends(server_state)) -> PlainTextResponse:
    """Check the adapter in full (its files, off the event loop; its shapes against the
    model, in the engine core) before it is listed: any refusal is a 400 naming why."""
    assert state.loras is not None  # the router is included only with a registry
    try:
        adapter = await asyncio.to_thread(state.loras.prepare, body.lora_name, body.lora_path)
        await state.engine.add_lora(adapter)
        try:
            state.loras.commit(adapter)
        except ValueError:  # the name was taken meanwhile: the core's copy goes again
            await state.engine.remove_lora(adapter.lora_int_id)
            raise
    except ValueError as e:
        raise bad_request(str(e), "lora_name" if "already loaded" in str(e) or "base model's name" in str(e)
                          else "lora_path") from None
    logger.info("LoRA adapter %s loaded from %s (id %d)", adapter.lora_name, adapter.lora_path, adapter.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: ServerState = Depends(server_state)) -> PlainTextResponse:
    """Unlisted at once; in the engine core its slot is freed once no request uses it."""
    assert state.loras is not None
    try:
        adapter = state.loras.remove(body.lora_name)
    except KeyError:
        raise OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.", 404, "NotFoundError",
                          "lora_name") from None
    await state.engine.remove_lora(adapter.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
