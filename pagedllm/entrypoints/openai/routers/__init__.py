"""The server's routes, one ``APIRouter`` per concern, over one ``ServerState`` (state.py).

- completions.py: ``/v1/completions``, ``/v1/chat/completions``
- responses.py: ``/v1/responses`` and the stored responses' GET, DELETE, cancel
- models.py: ``/v1/models``
- tokenize.py: ``/tokenize``, ``/detokenize``
- admin.py: ``/reset_prefix_cache`` (dev mode only: VLLM_SERVER_DEV_MODE=1); the runtime
  LoRA routes (only with --enable-lora and runtime updating allowed)
- kv.py: ``/v1/kv/save``, ``/v1/kv/restore`` (a prefix's KV by name in the disk offload tier)
- health.py: ``/health``, ``/ping``, ``/version``, ``/metrics``
- the dashboard's routes live with it (../dashboard.py)

Handlers are module-level functions; each reads the state through the ``server_state``
dependency, so a router holds no per-app closure and ``api_server.build_app`` only wires.
"""
