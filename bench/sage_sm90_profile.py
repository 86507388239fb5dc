"""One launch of the SM90 sage kernel per config at a Wan-like shape, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:_sage_fwd_sm90 --section WarpStateStats ... \\
        python3 bench/sage_sm90_profile.py "default=;kblk=k_granularity:block"
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sage_sm90 import _variants  # noqa: E402

from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90  # noqa: E402

B, S, H, D = 1, int(os.environ.get("PROF_S", "32760")), int(os.environ.get("PROF_H", "12")), 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for name, cfg in _variants(sys.argv[1] if len(sys.argv) > 1 else "default=").items():
    sage_attention_sm90(q, k, v, config=cfg)  # compile + warm (ncu skips by launch-skip)
    torch.cuda.synchronize()
    sage_attention_sm90(q, k, v, config=cfg)
    torch.cuda.synchronize()
    print(name, "done", flush=True)
