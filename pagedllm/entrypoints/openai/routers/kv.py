"""``/v1/kv/save`` and ``/v1/kv/restore``: a prompt prefix's KV kept under a name in the disk
offload tier and brought back later (llama-server's ``/slots/{id}?action=save|restore``, by
name instead of slot; docs/kv_offload.md). Both need ``--kv-offload-dir``; without it, or on a
backend without prefix-cache blocks, they answer a 400 naming why."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedllm.engine.async_llm import EngineNotReadyError, RequestFaultError
from pagedllm.engine.input_processor import PromptTooLongError
from pagedllm.entrypoints.openai.protocol import ChatMessage, RequestModel, random_id
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_base import bad_request, engine_error
from pagedllm.sampling_params import SamplingParams

router = APIRouter()


class KVSaveRequest(RequestModel):
    name: str
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    cache_salt: str | None = None


class KVRestoreRequest(RequestModel):
    name: str
    model: str | None = None


@router.post("/v1/kv/save")
async def kv_save(body: KVSaveRequest, state: ServerState = Depends(server_state)) -> dict:
    """Compute the prompt's KV if it is not cached (a one-token generation), then save its
    full blocks under ``name``; answers the tokens saved."""
    engine = state.engine
    state.resolve_model(body.model)
    state.check_ready()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        _, tokens = await state.chat.render(body.messages, None, body.add_generation_prompt)
    elif isinstance(body.prompt, list):
        tokens = body.prompt
    else:
        try:
            tokens = await engine.encode(body.prompt or "", body.add_special_tokens)
        except PromptTooLongError as e:
            raise bad_request(str(e), "prompt") from None
    try:
        async for _ in engine.generate(None, SamplingParams(max_tokens=1), random_id("kvsave"),
                                       prompt_token_ids=list(tokens), cache_salt=body.cache_salt):
            pass
        result = await engine.save_kv(body.name, list(tokens), body.cache_salt)
    except ValueError as e:
        raise bad_request(str(e), "name" if "name" in str(e) else None) from None
    except (EngineNotReadyError, RequestFaultError) as e:
        raise engine_error(e) from None
    if "error" in result:
        raise bad_request(result["error"], "name")
    return {"name": body.name, "num_tokens": result["num_tokens"], "num_prompt_tokens": len(tokens)}


@router.post("/v1/kv/restore")
async def kv_restore(body: KVRestoreRequest, state: ServerState = Depends(server_state)) -> dict:
    """Bring the KV saved under ``name`` into the prefix cache; answers the tokens restored."""
    state.resolve_model(body.model)
    state.check_ready()
    try:
        result = await state.engine.restore_kv(body.name)
    except (EngineNotReadyError, RequestFaultError) as e:
        raise engine_error(e) from None
    if "error" in result:
        raise bad_request(result["error"], "name")
    return {"name": body.name, "num_tokens": result["num_tokens"]}
