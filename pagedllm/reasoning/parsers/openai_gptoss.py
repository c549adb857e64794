"""gpt-oss's harmony format (reasoning/harmony.py): the `analysis` channel is the reasoning, the
`final` channel (and commentary preambles) the content; tool calls (a recipient) stay in the
content for the `openai` tool parser. The markers are special tokens, so a request served with
this parser keeps them in its output text (`needs_special_tokens`).

The output always starts inside the reasoning (a harmony turn opens with a header, whatever
the prompt holds): the end marker is the final answer's header, after which structured outputs
start their grammar and which a thinking budget writes (closing the analysis message first).
"""

from __future__ import annotations

from typing import Any

from pagedllm.reasoning.base import ReasoningParser, ReasoningSplit
from pagedllm.reasoning.harmony import CHANNEL, END, MESSAGE, START, split_harmony
from pagedllm.reasoning.stream import ReasoningDelta


class HarmonyStream:
    """One streamed output: each delta is the growth of the settled split of the text so far."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = ("", "")  # (reasoning, content) sent so far

    def _emit(self, final: bool) -> ReasoningDelta:
        reasoning, content = split_harmony(self._text, final)
        sent_r, sent_c = self._sent
        assert reasoning.startswith(sent_r) and content.startswith(sent_c), "harmony split not monotone"
        self._sent = (reasoning, content)
        return ReasoningDelta(reasoning[len(sent_r):], content[len(sent_c):])

    def feed(self, delta: str) -> ReasoningDelta:
        self._text += delta
        return self._emit(final=False)

    def finish(self) -> ReasoningDelta:
        return self._emit(final=True)


class GptOssReasoningParser(ReasoningParser):
    start_marker = f"{CHANNEL}analysis{MESSAGE}"
    end_marker = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
    needs_special_tokens = True

    def starts_in_reasoning(self, prompt_text: str | None, chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        return True

    def split(self, text: str, in_reasoning: bool) -> ReasoningSplit:
        reasoning, content = split_harmony(text, final=True)
        return ReasoningSplit(reasoning or None, content or None)

    def stream(self, in_reasoning: bool) -> HarmonyStream:  # type: ignore[override]
        return HarmonyStream()


PARSER = GptOssReasoningParser
