"""Run the SM90 sage kernel once per config on a small odd shape (for compute-sanitizer runs).

    compute-sanitizer --tool memcheck python3 bench/sage_sm90_sanitize.py "default=;kblk=k_granularity:block"
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sage_sm90 import _variants  # noqa: E402

from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90  # noqa: E402

for name, cfg in _variants(sys.argv[1] if len(sys.argv) > 1 else "default=").items():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 1000, 6, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 777, 3, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 777, 3, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    out, lse = sage_attention_sm90(q, k, v, return_lse=True, config=cfg)
    torch.cuda.synchronize()
    print(name, "ok", bool(torch.isfinite(out).all()), flush=True)
