"""``/tokenize`` (a prompt or chat messages) and ``/detokenize``: both bounded by the model's
length (a longer text or id list is a 400 before the tokenizer runs) and run on the tokenizer
thread, never on the event loop."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedllm.engine.input_processor import PromptTooLongError
from pagedllm.entrypoints.openai.limits import check_list_caps
from pagedllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_base import bad_request

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)) -> dict:
    engine = state.engine
    state.resolve_model(body.model)
    state.check_ready()
    assert engine.input_processor is not None and engine.model_config is not None
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    check_list_caps(body)
    if body.messages is not None:
        _, tokens, _ = await state.chat.render(body.messages, None, body.add_generation_prompt)
    else:
        try:
            tokens = await engine.encode(body.prompt or "", body.add_special_tokens)
        except PromptTooLongError as e:
            raise bad_request(str(e), "prompt") from None
    return {"count": len(tokens), "max_model_len": engine.model_config.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> dict:
    engine = state.engine
    state.resolve_model(body.model)
    state.check_ready()
    assert engine.model_config is not None
    max_len = engine.model_config.max_model_len
    if len(body.tokens) > max_len:
        raise bad_request(f"tokens has {len(body.tokens)} items, more than max_model_len={max_len}", "tokens")
    vocab = engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of the vocabulary [0, {vocab})", "tokens")
    return {"prompt": await engine.run_tokenizer(engine.tokenizer.decode, body.tokens)}
