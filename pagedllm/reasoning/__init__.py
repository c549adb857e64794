"""Reasoning parsers: where a reasoning model's thinking ends and its answer begins.

A reasoning model writes its thinking between markers (``<think>...</think>``); a chat template
may write the opening marker into the prompt (the output then holds only the closing one), or
open and close it there (thinking turned off). A parser knows its markers and when an output
starts inside the reasoning (``base.py``); ``stream.py`` splits text as it streams.

Users: the chat server splits each choice into ``reasoning_content`` and ``content``; the
engine core's structured-output manager starts a grammar only after the reasoning's end
marker (its token ids, ``ReasoningParser.end_token_ids``).

Registration is by place: every module of ``parsers/`` is a parser, named as the module, whose
``PARSER`` is a ``ReasoningParser`` subclass; nothing lists the names. Parsers import no torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from pagedllm.reasoning import parsers as _parsers

if TYPE_CHECKING:
    from pagedllm.reasoning.base import ReasoningParser

REASONING_PARSER_NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(_parsers.__path__) if not m.ispkg))


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError naming the choices otherwise."""
    if name not in REASONING_PARSER_NAMES:
        raise ValueError(f"reasoning_parser={name!r} is not one of {', '.join(REASONING_PARSER_NAMES)}")
    return importlib.import_module(f"{_parsers.__name__}.{name}").PARSER
