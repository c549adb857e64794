"""Run pagedllm's Triton kernels in Triton's interpreter, on CPU tensors, without the
setting leaking out of the tests that ask for it.

Triton reads TRITON_INTERPRET (through ``triton.knobs.runtime.interpret``) when a kernel is
decorated, its own library functions (``tl.sum``, ``tl.max``) at ``import triton``, and again
while launching (lazily imported parts of triton assert it). So: ``import_interpreted()``
sets it around the first import of triton and of the kernels (at collection), and the
``interpreter`` fixture (module-scoped) sets it again while a module's tests run; both
restore the environment after, so subprocesses later tests start do not inherit it.
tests/conftest.py calls ``import_interpreted()`` when pytest starts, before any test module
(or an import such as transformers' model classes, which imports triton) can import triton
compiled.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest

_KEY = "TRITON_INTERPRET"


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    previous = os.environ.get(_KEY)
    os.environ[_KEY] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_KEY]
        else:
            os.environ[_KEY] = previous


def import_interpreted() -> bool:
    """Import triton and the kernels under the interpreter; whether they are interpreted
    (False if triton was imported before without it, in this process)."""
    imported_before = "triton" in sys.modules
    with interpreter_env():
        from pagedllm.kernels.triton import triton_interpreted

        interpreted = triton_interpreted()
    assert interpreted or imported_before
    return interpreted


@pytest.fixture(scope="module")
def interpreter() -> Iterator[None]:
    with interpreter_env():
        yield
