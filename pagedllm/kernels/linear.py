"""The one place that picks CPU kernels for the matmuls of linear layers.

bf16 on a CPU without native bf16 goes to `bf16_linear` (bf16 weights, float32 arithmetic;
torch's own bf16 matmul is 3-9x slower than float32 there).

zentorch (AMD's torch extension) is used when it is importable and agrees with torch on a
probe for the dtype (e.g. its bf16 path needs avx512bf16); otherwise plain torch.
`PAGEDLLM_ZENTORCH=0` forces plain torch.

zentorch keeps a packed copy of every weight it has seen, keyed by the weight's address: a
weight written in place, or a new weight allocated where a freed one was, would be served
stale. So only module-owned weights (`persistent_weight=True`) take the zentorch path, every
weight write goes through the weight loaders, which call `clear_weight_caches()`, and code
that writes weights any other way must call it too. Temporary weights use plain torch.
Measured on the 2-core EPYC (fp32, 60 x [1536, 576] weights): batch 1 18.8 ms -> 11.3 ms,
batch 8 26.4 -> 16.3 ms, batch 128 114 -> 112 ms. Without the weight cache it is no faster.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from pagedllm.kernels.bf16 import bf16_linear, use_bf16_kernels
from pagedllm.platforms.host import is_host_tensor

logger = logging.getLogger(__name__)

# dtype -> whether zentorch's linear is usable (and agrees with torch) for it; filled lazily.
_zentorch_ok: dict[torch.dtype, bool] = {}


def _probe_zentorch(dtype: torch.dtype) -> bool:
    if os.environ.get("PAGEDLLM_ZENTORCH", "1") == "0":
        return False
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except ImportError:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    w = torch.randn(40, 96, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    try:
        with torch.no_grad():
            got = torch.ops.zentorch.zentorch_linear_unary(x, w, b)
            torch.ops.zentorch.zentorch_clear_weight_cache()  # the probe's weight dies here
    except RuntimeError as e:  # e.g. bf16 on a CPU without avx512bf16
        logger.info("zentorch linear unavailable for %s: %s", dtype, str(e).splitlines()[0])
        return False
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ok = bool(torch.allclose(got.float(), want, rtol=tol, atol=tol))
    logger.info("zentorch linear for %s: %s", dtype, "enabled" if ok else "disagrees, disabled")
    return ok


def linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    persistent_weight: bool = False,
) -> torch.Tensor:
    """x: [..., in], weight: [out, in], bias: [out] -> [..., out].

    persistent_weight: the weight is a module parameter written only through weight loaders,
    so kernels may cache a packed copy of it by address.
    """
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and use_bf16_kernels():
        if weight.is_contiguous() and is_host_tensor(x):
            return bf16_linear(x, weight, bias)
    if not persistent_weight:
        return F.linear(x, weight, bias)
    ok = _zentorch_ok.get(x.dtype)
    if ok is None:
        ok = _zentorch_ok[x.dtype] = _probe_zentorch(x.dtype)
    if ok and x.numel() > 0 and weight.dtype == x.dtype:
        return torch.ops.zentorch.zentorch_linear_unary(x, weight, bias)
    return F.linear(x, weight, bias)


def clear_weight_caches() -> None:
    """Forget packed weight copies held by the kernels; call after writing any weight."""
    if any(_zentorch_ok.values()):
        torch.ops.zentorch.zentorch_clear_weight_cache()
