"""Command-line flags generated from a dataclass's fields: a field's metadata carries its
flag's names, help and choices, so a flag cannot drift from its field (EngineArgs)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, field, fields
from typing import Any

_KEY = "pagedllm_flag"


def flag(
    default: Any,
    help: str,
    *,
    names: Sequence[str] = (),
    choices: Sequence[str] | None = None,
    type: Callable[[str], Any] | None = None,
    nargs: str | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field whose flag is ``--<name-with-dashes>`` (plus ``names``, e.g. vLLM's
    short aliases). Booleans take ``--x/--no-x``. Every flag's parser default is None ("not
    given"), so the field's default is the only one."""
    spec = {"help": help, "names": tuple(names), "choices": choices, "type": type, "nargs": nargs, "cli": cli}
    return field(default=default, metadata={_KEY: spec})


def flag_spec(f: Field) -> dict[str, Any] | None:
    """A field's flag metadata, None for a field without a flag."""
    spec = f.metadata.get(_KEY)
    return spec if spec is not None and spec["cli"] else None


def flag_name(f: Field) -> str:
    return "--" + f.name.replace("_", "-")


def _shown_default(f: Field) -> str:
    default = f.default if f.default is not MISSING else None
    return "" if default is None else f" (default: {default})"


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls`` that declares one."""
    for f in fields(cls):
        spec = flag_spec(f)
        if spec is None:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": spec["help"] + _shown_default(f)}
        if isinstance(f.default, bool) or spec["type"] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            for key in ("choices", "type", "nargs"):
                if spec[key] is not None:
                    kwargs[key] = list(spec[key]) if key == "choices" else spec[key]
        parser.add_argument(flag_name(f), *spec["names"], **kwargs)


def given_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of ``cls``'s fields that the command line gave (not None)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def json_dict(text: str) -> dict:
    """A JSON object flag value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
