"""A built wheel, installed in a fresh virtualenv outside the repo, decodes with the compiled
kernels: the wheel carries the C++ sources (pyproject's package-data), the installed package
builds (or finds the cached build of) its extensions, and the fused decode runs.

The new venv has no pip and no network: the wheel goes in with this venv's pip
(`pip --python`, --no-deps), and its dependencies (torch, transformers, ...) come from this
venv's site-packages through a .pth file. A path line in a .pth only appends to sys.path (the
.pth files inside that directory, such as the editable install of the repo, are not run), so
the venv's own site-packages, which holds the wheel's pagedllm, comes first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_DECODE = """
import json, sys
import pagedllm
from pagedllm import LLM, SamplingParams, kernels

llm = LLM(sys.argv[1], dtype="float32", matmul_activations="float32", max_model_len=256, kv_cache_memory_bytes="64MiB",
          max_num_seqs=4)
fused = llm.llm_engine.engine_core.runner.model.model.fused_layers
calls = []
fused.register_forward_hook(lambda *_: calls.append(1))
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
ops = {name: getattr(kernels.extension(name), "__file__", None) for name in kernels.EXTENSIONS}
print(json.dumps({
    "pagedllm": pagedllm.__file__,
    "csrc": str(kernels.build.CSRC),
    "ops": ops,
    "fused_calls": len(calls),
    "tokens": [o.outputs[0].token_ids for o in outputs],
}))
"""

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, **kwargs)
    assert out.returncode == 0, f"{cmd[:4]}... failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_installed_wheel_decodes_with_the_compiled_kernels(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # The wheel, built from a copy of the sources (an in-tree build would leave build/ and
    # *.egg-info in the checkout).
    src = tmp_path / "src"
    shutil.copytree(REPO / "pagedllm", src / "pagedllm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)])
    (wheel,) = (tmp_path / "dist").glob("pagedllm-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    _run([*pip, "--python", python, "install", "--no-deps", "-q", str(wheel)])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(site, "zz_pagedllm_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    run_dir = tmp_path / "run"  # outside the repo: nothing on sys.path but the venv's
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDLLM_CPU_ISA", "PAGEDLLM_CPU_KERNELS")}
    env["HF_HUB_OFFLINE"] = "1"
    out = _run([python, "-c", _DECODE, str(tiny_llama_dir), json.dumps(PROMPTS)], cwd=run_dir, env=env)
    got = json.loads(out.stdout.strip().splitlines()[-1])

    assert Path(got["pagedllm"]).is_relative_to(site), got["pagedllm"]
    assert Path(got["csrc"]).is_relative_to(site) and Path(got["csrc"], "decode_layers.cpp").is_file()
    for name in ("decode_layers", "layer_ops", "paged_attention"):  # the fused decode's ops
        assert got["ops"][name] is not None, (name, out.stderr[-2000:])
    assert got["fused_calls"] >= 7, got["fused_calls"]  # the 7 decode steps after the prefill

    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes="64MiB", max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got["tokens"] == want
