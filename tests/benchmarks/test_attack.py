"""`pagedllm bench attack`, small: one server with --api-key under the issue-48 attacks (stalled
readers, a 64 MiB body, a NaN adapter, malformed bodies, no key) beside well-behaved streams;
the bench exits 1 if an output differs from the attack-free run, an attack gets a 5xx (or a
2xx where a refusal is due), the NaN adapter is listed, a KV block stays in use, or the stop
is not clean."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.entrypoints.utils import REPO_ROOT

pytestmark = pytest.mark.slow


def test_attack_bench_small():
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "attack", "--streams", "4", "--rounds", "1",
           "--max-tokens", "16", "--stalled-clients", "8", "--stalled-max-tokens", "32", "--malformed", "40",
           "--lead-s", "1", "--", "--dtype", "float32", "--matmul-activations", "float32", "--max-model-len", "2048"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                         env={"OMP_NUM_THREADS": "1", **os.environ})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "outputs identical to the attack-free run: 4/4" in out.stdout
    assert "KV usage gauge after the attackers left: 0.0" in out.stdout
    assert "SIGTERM: exit 0" in out.stdout
