"""--enable-log-requests: one log line per request as it is queued, as vLLM's RequestLogger."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.entrypoints.openai.protocol import log_safe

logger = logging.getLogger(__name__)


class RequestLogger:
    """Logs each queued request: its id, prompt length and parameters at INFO, the prompt
    itself (text and ids, cut to max_log_len characters / ids) at DEBUG."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any) -> None:
        request_id = log_safe(request_id, 160)  # client-sent: one escaped, bounded line
        logger.info("Received request %s: num_prompt_tokens: %d, params: %s",
                    request_id, len(prompt_token_ids), params)
        if logger.isEnabledFor(logging.DEBUG):
            cut = self.max_log_len
            text = prompt if prompt is None or cut is None else prompt[:cut]
            ids = prompt_token_ids if cut is None else prompt_token_ids[:cut]
            logger.debug("Request %s prompt: %r, prompt_token_ids: %s", request_id, text, ids)
