"""DeepSeek R1 (and QwQ): ``<think>...</think>``. The model always thinks: its templates put
``<think>`` in the prompt, so the output usually holds only ``</think>``, and the text before
it is reasoning whether or not ``<think>`` appears in the output."""

from __future__ import annotations

from pagedllm.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    start_marker = "<think>"
    end_marker = "</think>"


PARSER = DeepSeekR1ReasoningParser
