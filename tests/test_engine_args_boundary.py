"""EngineArgs is the user-facing edge: only entrypoints/ and engine/arg_utils.py (its home)
import it; every component past the edge receives an EngineConfig or a part of it. Read with
``ast``, imports under ``if TYPE_CHECKING:`` included (a signature naming EngineArgs is the
dependency this forbids)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pagedllm"
ALLOWED_DIRS = ("entrypoints",)
ALLOWED_FILES = ("engine/arg_utils.py", "engine/arg_flags.py")
# Owned by the engineer splitting async_llm (Redesign 4, item 5): it still receives the
# front end's EngineArgs and hands them to CoreClient, which turns them into the config.
KNOWN = ("engine/async_llm.py",)


def engine_args_imports(source: str) -> list[int]:
    """Line numbers importing EngineArgs or the module that defines it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name for a in node.names}
            if module == "pagedllm.engine.arg_utils" or "EngineArgs" in names or (
                module == "pagedllm.engine" and "arg_utils" in names
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name == "pagedllm.engine.arg_utils" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_the_detector_sees_every_form() -> None:
    assert engine_args_imports("from pagedllm.engine.arg_utils import EngineArgs\n") == [1]
    assert engine_args_imports("if TYPE_CHECKING:\n    from pagedllm.engine.arg_utils import DEFAULT_MODEL\n") == [2]
    assert engine_args_imports("def f():\n    import pagedllm.engine.arg_utils\n") == [2]
    assert engine_args_imports("from pagedllm.engine import arg_utils\n") == [1]
    assert engine_args_imports("from pagedllm.config import EngineConfig\n") == []


def test_engine_args_are_imported_only_at_the_edge() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in ALLOWED_DIRS or rel in ALLOWED_FILES or rel in KNOWN:
            continue
        offenders += [f"pagedllm/{rel}:{line}" for line in engine_args_imports(path.read_text())]
    assert offenders == [], "EngineArgs past the edge (pass the EngineConfig or its part instead)"
