"""The consumer-to-producer messages of the ZMQ KV transport that need no torch (the proxy
sends releases too). A message is ``[kind, JSON]`` on a DEALER to the producer's ROUTER:
``pull`` ({transfer_id, hashes}) and ``release`` ({transfer_id})."""

from __future__ import annotations

import json

import zmq

PULL = b"pull"
RELEASE = b"release"
_RELEASE_LINGER_MS = 1000  # zmq keeps trying to deliver a release this long after close


def send_release(ctx: zmq.Context, host: str, port: int, transfer_id: str) -> None:
    """Tell a producer that ``transfer_id`` will not be pulled: it frees the blocks at once
    (unless a pull of them is in flight). Returns at once; zmq delivers in the background, and
    a producer that is gone frees them on its hold timeout."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, _RELEASE_LINGER_MS)
    sock.connect(f"tcp://{host}:{port}")
    try:
        # A connecting DEALER queues at once (the pipe exists before the TCP connect ends).
        sock.send_multipart([RELEASE, json.dumps({"transfer_id": transfer_id}).encode()], flags=zmq.NOBLOCK)
    except zmq.Again:
        pass
    finally:
        sock.close()
