"""The data-movement floor of bench/sparse.py (bench/gather_floor.py) reads exactly the listed tiles.

Runs in the Triton interpreter on CPU (conftest) and natively on a GPU."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
gather_floor = pytest.importorskip("gather_floor")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tma", [False, True])
def test_gather_reads_listed_tiles(tma):
    g = torch.Generator().manual_seed(3)
    bs, H, D, S = 16, 3, 32, 112
    k, v = (torch.randn(1, S, H, D, generator=g).to(torch.bfloat16).to(DEV) for _ in range(2))
    nq = S // bs
    idx = torch.stack([torch.randperm(nq, generator=g)[:4] for _ in range(H * nq)]).view(1, H, nq, 4)
    cnt = torch.randint(0, 5, (1, H, nq), generator=g)
    idx, cnt = idx.to(torch.int32).to(DEV), cnt.to(torch.int32).to(DEV)
    out = gather_floor.gather_kv(k, v, idx, cnt, block_size=bs, tma=tma)
    ref = gather_floor.gather_kv_reference(k, v, idx, cnt, block_size=bs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # dropping one listed tile changes the result: the gather really reads every listed tile
    cnt2 = cnt.clone()
    h, m = torch.nonzero(cnt[0] > 0)[0].tolist()
    cnt2[0, h, m] -= 1
    assert not torch.allclose(gather_floor.gather_kv(k, v, idx, cnt2, block_size=bs, tma=tma)[h, m], ref[h, m])
    assert gather_floor.bytes_moved(k, cnt, bs) == int(cnt.sum()) * 2 * bs * D * 2


def test_math_only_equals_diagonal_block_attention():
    g = torch.Generator().manual_seed(4)
    bs, H, D, S = 16, 2, 32, 64
    q, k, v = (torch.randn(1, S, H, D, generator=g).to(torch.bfloat16).to(DEV) for _ in range(3))
    cnt = torch.randint(1, 4, (1, H, S // bs), generator=g).to(torch.int32).to(DEV)
    out = gather_floor.math_only(q, k, v, cnt, block_size=bs)
    qb, kb, vb = (t[0].float().view(S // bs, bs, H, D).permute(2, 0, 1, 3) for t in (q, k, v))  # [H, nb, bs, D]
    ref = torch.softmax(qb @ kb.transpose(-1, -2) * D**-0.5, -1) @ vb
    torch.testing.assert_close(out[0].float(), ref.permute(1, 2, 0, 3).reshape(S, H, D), atol=2e-2, rtol=2e-2)
