#!/usr/bin/env bash
# Here, on a machine with network: the wheels pagedllm needs that the GPU machine's image
# lacks (docs/gpu.md), at the versions of this venv, for Python 3.12 x86-64, into .whl/
# (ignored by git; the device tool carries it: carry=[".whl"]). Pure-Python packages come
# as py3 wheels; pydantic-core, pyzmq, jiter and xgrammar as manylinux builds.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
PY=${PY:-python3}
names="pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn pyzmq gguf
xgrammar openai distro jiter sniffio partial-json-parser"
pins=$($PY - $names <<'PY'
import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))
PY
)
platforms=""
for n in 28 27 24 17; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
du -sh .whl
