"""From StructuredOutputsParams to an xgrammar grammar.

JSON is constrained to a compact form: separators "," and ":" with no whitespace around them
(the basic any-JSON values inside a ``json_object`` use xgrammar's fixed ", " / ": "), so
the model cannot run away emitting whitespace.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

JSON_SEPARATORS = (",", ":")
"""Between items and between a key and its value: compact JSON, no whitespace."""
_JSON_OBJECT_SCHEMA = {"type": "object", "additionalProperties": True}
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _error_text(e: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__


def build_grammar(spec: StructuredOutputsParams) -> Any:
    """The spec as an (uncompiled) xgrammar Grammar; ValueError naming the field if invalid."""
    import xgrammar as xgr

    kind = spec.key[0]
    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        if spec.grammar is not None:
            return xgr.Grammar.from_ebnf(spec.grammar)
        if spec.structural_tag is not None:
            return _structural_tag_grammar(spec.structural_tag)
        return xgr.Grammar.from_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False, separators=JSON_SEPARATORS)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own errors
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar",
                "structural_tag": "structural tag"}
        raise ValueError(
            f"structured_outputs.{kind}: invalid {what.get(kind, kind)}: {_error_text(e)}"
        ) from None


def _structural_tag_grammar(tag: dict[str, Any]) -> Any:
    """xgrammar's structural tag; the older form (``structures`` and ``triggers``, which
    vLLM's response_format structural_tag carries) through xgrammar's older call."""
    import xgrammar as xgr

    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(tag)
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            for s in structures):
        raise ValueError('needs "structures": [{"begin": ..., "schema": {...}, "end": ...}] and "triggers": [...]')
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"])
             for s in structures]
    return xgr.Grammar.from_structural_tag(items, triggers)


@functools.lru_cache(maxsize=512)
def _validate_key(kind: str, text: str) -> None:
    """Raises ValueError for an invalid spec; valid keys are remembered (no re-parse)."""
    build_grammar(_spec_from_key(kind, text))


def _spec_from_key(kind: str, text: str) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=json.loads(text))
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(text))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(**{kind: text})


def validate(spec: StructuredOutputsParams) -> None:
    """Check that the spec compiles to a grammar (no tokenizer needed): a ValueError names
    the problem. Cheap next to compiling; run it where the request enters the engine."""
    _validate_key(*spec.key)


def compile_spec(compiler: Any, spec: StructuredOutputsParams) -> Any:
    """Compile with the engine's vocabulary (the slow part: a mask per grammar state)."""
    try:
        if spec.json is not None:
            return compiler.compile_json_schema(spec.json, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_ebnf(spec.choice))
        if spec.grammar is not None:
            return compiler.compile_grammar(spec.grammar)
        if spec.structural_tag is not None:
            return compiler.compile_grammar(build_grammar(spec))
        return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False, separators=JSON_SEPARATORS)
    except Exception as e:
        raise ValueError(f"structured_outputs.{spec.key[0]}: cannot compile: {_error_text(e)}") from None
