"""A local multi-node Ray cluster on 127.0.0.1 for tests and benchmarks (``ray.cluster_utils``).

Run as a process of its own (``LocalRayCluster`` starts it): it starts a head and more nodes,
each with ``--cpus-per-node`` CPUs and pinned to its own cores of this machine (a node's
raylet, and so every worker it starts, inherits the affinity the process had when the node
started), prints the cluster's address, and shuts the cluster down when its stdin closes.
Ray binds loopback only with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` set before it is imported
(``ray start --address`` then refuses to join a second node; ``cluster_utils`` does not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def node_cores(num_nodes: int, cpus_per_node: int, available: list[int] | None = None) -> list[list[int]]:
    """Each node's cores: consecutive shares of the cores this process may use (shared
    round-robin when there are fewer cores than asked)."""
    available = sorted(os.sched_getaffinity(0)) if available is None else available
    return [[available[(n * cpus_per_node + i) % len(available)] for i in range(cpus_per_node)]
            for n in range(num_nodes)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=1)
    args = parser.parse_args()
    os.environ.update(LOOPBACK_ENV)
    from ray.cluster_utils import Cluster

    own = os.sched_getaffinity(0)
    cores = node_cores(args.nodes, args.cpus_per_node)
    # Ray's files (its address file included) in a directory of this cluster's own, so no
    # other Ray user on the machine finds it; short: Ray's socket paths must fit 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"))  # where Ray writes under RAY_TMPDIR
    os.sched_setaffinity(0, cores[0])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": args.cpus_per_node, "include_dashboard": False, "temp_dir": os.path.join(temp_dir, "ray")})
    for node in range(1, args.nodes):
        os.sched_setaffinity(0, cores[node])
        cluster.add_node(num_cpus=args.cpus_per_node)
    os.sched_setaffinity(0, own)
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    sys.stdin.read()  # until the owner closes it (or dies)
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


class LocalRayCluster:
    """Start the cluster process; ``address`` for RAY_ADDRESS; ``stop()`` ends it."""

    def __init__(self, num_nodes: int = 2, cpus_per_node: int = 1, timeout_s: float = 180.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.ray_cluster", "--nodes", str(num_nodes),
             "--cpus-per-node", str(cpus_per_node)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **LOOPBACK_ENV},
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.wait(timeout_s)
            raise RuntimeError(f"the local Ray cluster did not start (exit code {self.proc.returncode})")
        self.address = line
        self.env = {**LOOPBACK_ENV, "RAY_ADDRESS": self.address}

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    main()
