"""No device-name comparison outside ``pagedllm/platforms/``: code asks the platform
(``platform_of(device).uses_host_memory``, ``supports_graph_capture``, ...) or, for a
kernel's per-tensor dispatch, ``platforms.host`` (``is_host_tensor``, ``in_host_memory``). Read with ``ast``, so
strings and comments do not count.

Flagged: a comparison (``==``, ``!=``, ``in``, ``is``) with a device name ("cpu", "cuda",
also inside a tuple, list or set), ``.startswith("cuda")``-style tests, ``.is_cuda`` /
``.is_cpu``, ``cuda.is_available``, and ``.type`` read off a device (``x.device.type``,
``device.type``, ``torch.device(d).type``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from pagedllm.platforms.host import in_host_memory, is_host_tensor
from pagedllm.platforms.registry import PLATFORMS, platform_of

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"
PLATFORMS_DIR = PACKAGE / "platforms"
DEVICE_NAMES = frozenset({"cpu", "cuda"})


def _is_device_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_device_name(e) for e in node.elts)
    return False


def _names_a_device(node: ast.AST) -> bool:
    """``device``, ``x.device``, ``self.kv_device``, ``torch.device(...)``."""
    if isinstance(node, ast.Name):
        return "device" in node.id
    if isinstance(node, ast.Attribute):
        return "device" in node.attr
    if isinstance(node, ast.Call):
        return _names_a_device(node.func)
    return False


def device_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, what) for each device-name test in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_is_device_name(n) for n in (node.left, *node.comparators)):
            found.append((node.lineno, "comparison with a device name"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "startswith", "endswith"
        ) and any(_is_device_name(a) for a in node.args):
            found.append((node.lineno, f".{node.func.attr}(device name)"))
        elif isinstance(node, ast.Attribute):
            if node.attr in ("is_cuda", "is_cpu"):
                found.append((node.lineno, f".{node.attr}"))
            elif node.attr == "is_available" and isinstance(node.value, ast.Attribute) and node.value.attr == "cuda":
                found.append((node.lineno, "cuda.is_available"))
            elif node.attr == "type" and _names_a_device(node.value):
                found.append((node.lineno, "device .type"))
    return sorted(found)


def test_detector_finds_each_form_and_ignores_strings():
    source = (
        'a = x.device.type == "cpu"\n'
        'b = device != "cuda"\n'
        'c = d in ("cuda", "mps")\n'
        "e = t.is_cuda\n"
        "f = torch.cuda.is_available()\n"
        "g = torch.device(d).type\n"
        'h = str(d).startswith("cuda")\n'
        'i = name == "cuda:1"\n'
        'ok = "device.type == \'cpu\'"  # a string, not code\n'
        'ok2 = backend == "triton"\n'
        'ok3 = torch.device("cpu")\n'
        "ok4 = tensor.dtype\n"
    )
    assert [line for line, _ in device_comparisons(source)] == [1, 1, 2, 3, 4, 5, 6, 7, 8]


def test_no_device_comparisons_outside_platforms():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PLATFORMS_DIR in path.parents:
            continue
        for line, what in device_comparisons(path.read_text()):
            offenders.append(f"  {path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, (
        "device-name tests outside pagedllm/platforms/ (ask the platform for a capability, or "
        "platforms.host.is_host_tensor for a kernel's per-tensor dispatch):\n" + "\n".join(offenders)
    )


def test_host_memory_agrees_with_each_platform():
    """The kernels' per-tensor answer and each platform's declaration are one fact."""
    for device, platform in PLATFORMS.items():
        assert in_host_memory(device) == platform.uses_host_memory, device
        assert platform_of(f"{device}:0") is platform
    cpu_tensor = torch.zeros(1)
    assert is_host_tensor(cpu_tensor) and in_host_memory(cpu_tensor.device) and not in_host_memory("cuda:0")
    assert PLATFORMS["cpu"].runs_compiled_kernels and PLATFORMS["cpu"].supports_weight_quantization
    assert not PLATFORMS["cuda"].runs_compiled_kernels and not PLATFORMS["cuda"].supports_weight_quantization
