"""The chat server's reasoning: ``--reasoning-parser`` applied to one request's choices.

For each request: whether its output starts inside the reasoning (the prompt, and
``chat_template_kwargs`` such as ``enable_thinking``); its structured output is told so (the
grammar starts after the reasoning); each choice's text is split into ``reasoning_content``
and ``content``, whole or delta by delta. Tool-call parsing runs on the content part. A
thinking budget (the request's ``thinking_token_budget``, else ``--reasoning-budget``) goes to
the engine with a request whose output starts inside the reasoning (reasoning/budget.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.serving_base import bad_request
from pagedllm.reasoning import get_reasoning_parser
from pagedllm.reasoning.base import ReasoningParser, ReasoningSplit
from pagedllm.reasoning.stream import ReasoningDelta, ReasoningStream
from pagedllm.sampling_params import SamplingParams


class RequestReasoning:
    """One chat request's reasoning split (a pass-through without a parser)."""

    def __init__(
        self, parser: ReasoningParser | None, prompt_text: str | None,
        chat_template_kwargs: dict[str, Any] | None, include_reasoning: bool = True,
        thinking_token_budget: int | None = None,
    ) -> None:
        self.parser = parser
        self.in_reasoning = parser is not None and parser.starts_in_reasoning(prompt_text, chat_template_kwargs)
        """Whether the output starts inside the reasoning."""
        self.include_reasoning = include_reasoning
        self.thinking_token_budget = thinking_token_budget if self.in_reasoning else None

    def apply_to(self, params: Any) -> None:
        """Tell the request's grammar (structured outputs, forced tool calls) whether to wait
        for the reasoning's end; an explicit ``reasoning_ended`` in the request stays."""
        if self.parser is None or not isinstance(params, SamplingParams):
            return
        if self.parser.needs_special_tokens:  # the markers must reach the split
            params.skip_special_tokens = False
        params.thinking_token_budget = self.thinking_token_budget
        spec = params.structured_outputs
        if spec is not None and spec.reasoning_ended is None:
            spec.reasoning_ended = not self.in_reasoning

    def split(self, text: str) -> ReasoningSplit:
        """A finished choice's (reasoning, content)."""
        if self.parser is None:
            return ReasoningSplit(None, text)
        split = self.parser.split(text, self.in_reasoning)
        return split if self.include_reasoning else ReasoningSplit(None, split.content)

    def stream(self) -> ChoiceStream:
        """A splitter for one streamed choice."""
        if self.parser is None:
            return ChoiceStream(None, True)
        return ChoiceStream(self.parser.stream(self.in_reasoning), self.include_reasoning)


class ChoiceStream:
    """Deltas of one choice -> (reasoning, content) deltas; ``finished`` flushes the held text."""

    def __init__(self, stream: ReasoningStream | None, include_reasoning: bool) -> None:
        self._stream = stream
        self._include = include_reasoning

    def feed(self, delta: str, finished: bool) -> ReasoningDelta:
        if self._stream is None:
            return ReasoningDelta("", delta)
        part = self._stream.feed(delta)
        if finished:
            rest = self._stream.finish()
            part = ReasoningDelta(part.reasoning + rest.reasoning, part.content + rest.content)
        return part if self._include else ReasoningDelta("", part.content)


class ServerReasoning:
    """The server's parser, built on first use (the tokenizer arrives with the engine)."""

    def __init__(self, engine: Any, name: str | None) -> None:
        self.engine = engine
        self.name = name
        self._parser: ReasoningParser | None = None

    def for_request(
        self, prompt_text: str | None, chat_template_kwargs: dict[str, Any] | None, include_reasoning: bool = True,
        thinking_token_budget: int | None = None,
    ) -> RequestReasoning:
        """``thinking_token_budget``: the request's (None: the server's; -1: no limit)."""
        if thinking_token_budget is not None and thinking_token_budget != -1 and self.name is None:
            raise bad_request("thinking_token_budget needs a server started with --reasoning-parser",
                              "thinking_token_budget")
        if thinking_token_budget is not None and thinking_token_budget < -1:
            raise bad_request(f"thinking_token_budget must be -1 (no limit) or at least 0, got {thinking_token_budget}",
                              "thinking_token_budget")
        if thinking_token_budget is None:
            thinking_token_budget = getattr(self.engine.args, "reasoning_budget", -1)
        if self.name is not None and self._parser is None:
            self._parser = get_reasoning_parser(self.name)(self.engine.tokenizer)
        budget = None if thinking_token_budget == -1 else thinking_token_budget
        return RequestReasoning(self._parser, prompt_text, chat_template_kwargs, include_reasoning, budget)
