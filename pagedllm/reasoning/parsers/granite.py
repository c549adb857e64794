"""IBM Granite 3.x (3.2, 3.3): no marker tokens; the model writes its thinking after "Here is
my thought process:" and its answer after "Here is my response:" (quantized models have been
seen writing "Here's my ..."; both spellings count, as in vLLM's `granite` parser).

Thinking is off unless the request turns it on with Granite's template switch,
``chat_template_kwargs: {"thinking": true}``. The prompt is not read for markers: the system
message Granite's template writes when thinking is on quotes both phrases. Thinking on, the
output is reasoning only if it opens with the thought-process phrase; otherwise all of it is
content (the model answered straight away).
"""

from __future__ import annotations

from typing import Any

from pagedllm.reasoning.base import ReasoningParser


class GraniteReasoningParser(ReasoningParser):
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
    start_required = True

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return bool((chat_template_kwargs or {}).get("thinking"))

    def starts_in_reasoning(self, prompt_text: str | None, chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        return self.thinking_enabled(chat_template_kwargs)


PARSER = GraniteReasoningParser
