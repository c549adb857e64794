"""Disaggregated prefill/decode: KV connectors move prompt KV blocks between instances.

``base.py`` is the connector interface (scheduler side and worker side, as vLLM's v1
``KVConnectorBase``); ``zmq_connector.py`` is the scheduler side and ``zmq_worker.py`` the
transport of the one implementation (pyzmq over TCP); ``proxy.py`` is `pagedllm proxy`.
"""
