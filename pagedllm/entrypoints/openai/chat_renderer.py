"""Chat prompts rendered off the event loop, and per-request chat templates bounded in time.

The server's template (``--chat-template`` or the model's) is trusted: it is rendered on the
engine's tokenizer thread. A template sent in a request is arbitrary Jinja: it is refused
unless the server runs with ``--trust-request-chat-template``, and then rendered in a separate
process that is killed when it runs past ``request_chat_template_timeout_s`` (a thread cannot
stop a Jinja loop, and counting calls inside a sandbox misses loops whose bodies call
nothing). The process is spawned at the first such request and again after each kill; one
render at a time.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.input_processor import render_chat_text
from pagedllm.entrypoints.openai.tool_parsers.chat_template import choose_chat_template
from pagedllm.process_utils import die_with_parent

logger = logging.getLogger(__name__)

SANDBOX_START_TIMEOUT_S = 120.0
"""Spawning the render process and unpickling the tokenizer there (not part of the budget)."""


class ChatTemplateError(ValueError):
    """The messages or the template are refused (the server's 400)."""


SANDBOX_MEMORY_HEADROOM_BYTES = 1 << 30
"""Address space the render process may grow by once started: a template that builds a larger
string ('a' * 10**10) gets a MemoryError (a 400) instead of exhausting the host."""


def _limit_address_space(headroom: int) -> None:
    """RLIMIT_AS at this process's current virtual size plus headroom (Linux; elsewhere none)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = vm_bytes + headroom
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, OSError, ValueError):
        pass


def _sandbox_main(conn: Any, tokenizer: Any, parent_pid: int) -> None:
    """The render process: (messages, template, add_generation_prompt, chat_template_kwargs,
    options) in (options: render_chat_text's keyword arguments: tools, continue_final_message,
    documents), ("ok", text) or ("error", message) out, until the pipe closes."""
    die_with_parent(parent_pid)
    _limit_address_space(SANDBOX_MEMORY_HEADROOM_BYTES)
    conn.send(("ready", None))
    while True:
        try:
            messages, template, add_generation_prompt, chat_template_kwargs, options = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", render_chat_text(
                tokenizer, messages, template, add_generation_prompt, chat_template_kwargs, **options)))
        except ValueError as e:  # the template refused the messages (its message says so)
            conn.send(("error", str(e)))
        except Exception as e:  # noqa: BLE001 -- anything else a template can raise
            conn.send(("error", f"the chat template failed: {type(e).__name__}: {e}"))


class TemplateSandbox:
    """One render process for untrusted templates; blocking calls, run on its own thread."""

    def __init__(self, tokenizer: Any, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_sandbox_main, args=(child_conn, self.tokenizer, os.getpid()),
                                 name="pagedllm-chat-template", daemon=True)
        self._proc.start()
        child_conn.close()
        if not self._conn.poll(SANDBOX_START_TIMEOUT_S):
            self.close()
            raise RuntimeError("the chat-template process did not start")
        self._conn.recv()

    def render(self, messages: list[dict], template: str, add_generation_prompt: bool,
               chat_template_kwargs: dict[str, Any] | None, options: dict[str, Any]) -> str:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((messages, template, add_generation_prompt, chat_template_kwargs, options))
            if not self._conn.poll(self.timeout_s):
                logger.warning("a request's chat template ran past %.1f s; killing its process", self.timeout_s)
                self.close()
                raise ChatTemplateError(
                    f"the request's chat_template did not render within {self.timeout_s:g} s")
            status, value = self._conn.recv()
        if status != "ok":
            raise ChatTemplateError(value)
        return value

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None


class ChatRenderer:
    """Messages -> (prompt text, token ids), never on the event loop."""

    def __init__(self, engine: AsyncLLM, chat_template: str | None, trust_request_chat_template: bool,
                 request_chat_template_timeout_s: float) -> None:
        self.engine = engine
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.request_chat_template_timeout_s = request_chat_template_timeout_s
        self._sandbox: TemplateSandbox | None = None
        self._sandbox_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-chat-template")

    async def render(
        self, messages: list[dict], request_chat_template: str | None, add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None, *,
        continue_final_message: bool = False, documents: list[dict] | None = None, add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """ChatTemplateError (a 400) if the template refuses the messages, or a request's
        template is not allowed or runs out of time. Tools or tool messages under a model
        template that knows no tools use the shipped tool template (tool_parsers/chat_template.py)."""
        processor = self.engine.input_processor
        assert processor is not None
        options: dict[str, Any] = {
            "tools": tools, "continue_final_message": continue_final_message, "documents": documents}
        if not request_chat_template:
            template = choose_chat_template(self.chat_template, self.engine.tokenizer.chat_template, messages, tools)
            try:
                return await self.engine.run_tokenizer(
                    processor.render_chat, messages, template, add_generation_prompt, chat_template_kwargs,
                    add_special_tokens=add_special_tokens, **options)
            except ValueError as e:
                raise ChatTemplateError(str(e)) from None
        if not self.trust_request_chat_template:
            raise ChatTemplateError(
                "chat_template in a request is refused: this server runs the server's template only "
                "(start it with --trust-request-chat-template to allow per-request templates)")
        if self._sandbox is None:
            self._sandbox = TemplateSandbox(self.engine.tokenizer, self.request_chat_template_timeout_s)
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(
            self._sandbox_thread, self._sandbox.render, messages, request_chat_template, add_generation_prompt,
            chat_template_kwargs, options)
        # The template writes any BOS itself: special tokens are added again only when asked.
        try:
            return text, await self.engine.run_tokenizer(processor.encode_rendered, text, add_special_tokens)
        except ValueError as e:  # longer than max_model_len tokens could spell
            raise ChatTemplateError(str(e)) from None

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
        self._sandbox_thread.shutdown(wait=False)
