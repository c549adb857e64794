"""`python -m pagedllm.benchmarks NAME ...`: the same as `pagedllm bench NAME ...`."""

import sys

from pagedllm.entrypoints.cli import main

main(["bench", *sys.argv[1:]])
