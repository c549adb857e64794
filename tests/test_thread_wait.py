import os
import subprocess
import sys

from pagedllm.thread_wait import DEFAULT_SPIN_COUNT, set_default_spin_count


def test_spin_count_defaults_only_where_unset() -> None:
    env: dict[str, str] = {}
    assert set_default_spin_count(env) and env["GOMP_SPINCOUNT"] == DEFAULT_SPIN_COUNT
    explicit = {"GOMP_SPINCOUNT": "300000"}
    assert not set_default_spin_count(explicit) and explicit == {"GOMP_SPINCOUNT": "300000"}
    passive = {"OMP_WAIT_POLICY": "passive"}
    assert not set_default_spin_count(passive) and "GOMP_SPINCOUNT" not in passive


def test_importing_pagedllm_sets_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import sys, os, pagedllm; print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", DEFAULT_SPIN_COUNT]
