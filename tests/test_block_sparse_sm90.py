"""The SM90 Gluon block-sparse kernel (ditattn.attention.kernels.block_sparse_sm90).

* CPU (no GPU needed): it compiles for sm_90 with the static-max and the online softmax, keeps its
  wgmma products asynchronous (no wait after every product: ptxas serialises a kernel whose
  in-flight operands are redefined) and does not spill.
* GPU (SM90 only): numerics against float32 with the same block mask — odd padded lengths,
  padding keys, GQA, an empty query block (zeros, LSE -inf), an odd number of query blocks, both
  softmax paths.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

_OFFLINE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sm90_offline as so
so.install_offline_driver()
out = {}
for name, cfg in (("static", {}), ("online", {"static_max": False})):
    kern = so.compile_block_sparse(cfg)
    out[name] = so.analyse(so.sass_of(kern.asm["cubin"], sys.argv[2] + "/" + name + ".cubin"))
print(json.dumps(out))
"""


def test_block_sparse_kernel_compiles_for_sm90_with_async_wgmma(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _OFFLINE, os.path.join(ROOT, "bench"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, a in res.items():
        c = a["loop_census"]
        assert c.get("HGMMA", 0) >= 12, (name, c)  # Q.K (8 k-steps) and P.V (4)
        assert c.get("WARPGROUP", 0) <= 8, (name, c)  # one fence/commit/wait set per key block
        assert a["spills"] == 0, (name, a["spills"])
    assert res["static"]["loop_census"].get("FMNMX", 0) == 0  # no running maximum in the static loop
    assert res["online"]["loop_census"].get("FMNMX", 0) >= 32


def _lists(b, h, nq, keep, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(nq, generator=g)[:keep] for _ in range(nq)]) for _ in range(b * h)])
    idx = idx.view(b, h, nq, keep).to(torch.int32)
    cnt = torch.randint(1, keep + 1, (b, h, nq), generator=g, dtype=torch.int32)
    return idx.cuda(), cnt.cuda()


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("b,h,hkv,d,s_real,q_scale,static", [
    (2, 6, 3, 128, 1064, 1.0, True),   # GQA, padding, even number of query blocks
    (1, 4, 4, 64, 777, 1.0, True),     # head dim 64, odd number of query blocks
    (1, 2, 2, 128, 700, 12.0, True),   # logit bound > limit: the online path runs
    (1, 2, 1, 128, 333, 1.0, False),   # online softmax forced
])
def test_block_sparse_sm90_numerics(b, h, hkv, d, s_real, q_scale, static):
    from ditattn.attention.backends.base import reference_attention
    from ditattn.attention.kernels.block_sparse_sm90 import block_sparse_attention_sm90
    from ditattn.attention.sparse.block_sparse import block_lists_to_dense_mask

    bs = 64
    s = math.ceil(s_real / bs) * bs
    nq = s // bs
    g = torch.Generator(device="cuda").manual_seed(s_real)
    q = (torch.randn(b, s, h, d, generator=g, device="cuda") * q_scale).bfloat16()
    k = torch.randn(b, s, hkv, d, generator=g, device="cuda").bfloat16()
    v = torch.randn(b, s, hkv, d, generator=g, device="cuda").bfloat16()
    idx, cnt = _lists(b, h, nq, max(1, nq // 3), seed=s_real)
    cnt[0, 0, 1] = 0  # an empty query block
    valid = torch.arange(s, device="cuda")[None, :].expand(b, s) < s_real
    out, lse = block_sparse_attention_sm90(q, k, v, idx, cnt, block_size=bs, kv_valid=valid, return_lse=True,
                                           config={"static_max": static})
    mask = block_lists_to_dense_mask(idx, cnt, block_size=bs, kv_valid=valid)
    ref, ref_lse = reference_attention(q, k, v, mask=mask)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 6e-3  # bf16 rounding of P and of the output
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert float((lse[fin] - ref_lse[fin]).abs().max()) < 1e-2
    assert (out[0, bs:2 * bs, 0] == 0).all()
