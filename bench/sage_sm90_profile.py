"""One launch of the SM90 sage kernel per config at a Wan-like shape, for Nsight Compute.  Each config runs
twice (the first compiles and warms: profile the second); the variant name ``fa4`` runs FlashAttention-4's
forward instead (the bf16 baseline, same inputs).

    ncu --clock-control none --kernel-name regex:"_sage_fwd_sm90|FlashAttentionForwardSm90" \\
        --section WarpStateStats ... python3 bench/sage_sm90_profile.py "default=;kblk=k_granularity:block;fa4="

PROF_S / PROF_H set the sequence length (default 32760) and the head count (default 12); head dim 128, bf16.
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
    if name == "fa4":
        from flash_attn.cute import flash_attn_func

        def call():
            return flash_attn_func(q, k, v)
    else:
        def call(cfg=cfg):
            return sage_attention_sm90(q, k, v, config=cfg)
    for _ in range(2):  # compile + warm, then the launch to read
        call()
        torch.cuda.synchronize()
    print(name, "done", flush=True)
