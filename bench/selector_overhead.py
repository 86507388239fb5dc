"""Per-call cost of backend selection on the CPU.

Times the same tiny attention call three ways: the backend implementation called directly, through a
``LocalAttention`` layer (backend resolved at construction; per call it reads the request override
table and the forward context), and through ``ditattn.attention(...)`` (decision cached per call
signature).  The differences are the per-call overhead of ditattn's dispatch.

    python bench/selector_overhead.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def per_call_us(fn, n=20000):
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main():
    import ditattn
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.context import component_scope
    from ditattn.attention.layer import LocalAttention
    from ditattn.attention.names import AttentionBackendEnum as B

    torch.set_num_threads(1)
    q = torch.randn(1, 16, 2, 32)
    impl = get_impl(B.TORCH_SDPA)
    call = AttnCall()
    with component_scope("transformer"):
        layer = LocalAttention(2, 32, dtype=torch.float32)
    with torch.no_grad():
        direct = per_call_us(lambda: impl(q, q, q, call, {}))
        via_layer = per_call_us(lambda: layer(q, q, q))
        via_fn = per_call_us(lambda: ditattn.attention(q, q, q))
    print(f"{'path':<36} {'us/call':>8} {'overhead':>9}")
    for name, t in (
        ("backend impl directly", direct),
        ("LocalAttention (resolved at build)", via_layer),
        ("ditattn.attention() (cached)", via_fn),
    ):
        print(f"{name:<36} {t:8.2f} {t - direct:8.2f}")


if __name__ == "__main__":
    main()
