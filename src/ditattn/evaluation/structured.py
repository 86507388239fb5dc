"""Structured attention inputs at video grids: q/k with Wan's 3-D RoPE so attention decays with distance.

i.i.d. random q/k give nearly uniform attention rows, on which every sparse selection has an error
of order 1.  Here, per head, q and k share a *content vector* ``a`` and differ by noise, and both
are rotated by Wan's 3-D rotary embedding at their token's ``(t, h, w)``::

    q_i = R(p_i) (a + n_i),   k_j = R(p_j) (a + m_j),   n, m ~ N(0, noise^2 I),   v ~ N(0, I)

so ``q_i . k_j = sum_pairs |a_pair|^2 cos(w_pair (p_j - p_i)) + noise terms``: the score peaks at
the query's own position and decays with 3-D distance at the rates of the RoPE frequencies that
carry ``a``'s energy.  ``|a|`` is drawn uniformly in ``content_norm`` (10-16 by default, so the
peak logit ``|a|^2 / sqrt(128)`` is 9-23).  Which RoPE channels carry the energy sets the head's
type (Wan's channel split: for head dim 128, 22 time pairs then 21 height and 21 width pairs, each
from frequency 1 down to about 1e-4 rad per position):

* ``spatial``: 40 % of the energy in the fastest third of the time pairs (attention stays in the
  query's own and adjacent frames) and 30 % each spread over all height/width pairs (smooth decay
  across the frame);
* ``temporal``: 40 % each in the fastest third of the height/width pairs (the same place in every
  frame), 20 % in the slowest time pairs (almost no decay over time);
* ``global``: all energy in the slowest third of every axis (near-constant scores: broad attention
  shaped by the noise, the hard case for any sparse selection).

* ``local``: all energy in the fastest third of every axis (very local: a few tokens around the
  query carry the row);
* ``near_global``: all energy in the slowest pairs of every axis at a third of the head's content
  norm (almost flat scores: the broadest head).

Every head also has a small fixed component along its slowest pair of each axis (norm
``sink_align``); ``sinks`` tokens (evenly spaced, plus token 0) add ``sink_gain * peak`` along it
to their keys, so every query gives them a logit close to its own peak: attention sinks.  Heads
cycle through ``types``.  Generation runs head by head on the target device (float32, then cast).

Values: ``values="iid"`` draws ``v ~ N(0, I)``; ``values="smooth"`` gives a spatially smooth value
field: Gaussian noise on the ``(T, H, W)`` grid low-pass filtered (a Gaussian of ``smooth_scale``
grid cells per axis, in the Fourier domain), per channel normalised to unit variance, plus 0.1 of
i.i.d. noise — neighbouring tokens carry nearly the same value, as in a real latent video.

:data:`FAMILIES` names the families the benchmarks and tests use (``original``: the defaults above;
``weak``: content norms 3-8; ``mixed``: very local and near-global heads in one layer; ``smooth``:
smooth values; ``weak_mixed_smooth``: all three).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor

HEAD_TYPES = ("spatial", "temporal", "global")
#: per head type: (axis energy fractions (t, h, w), bands ('fast' | 'all' | 'slow') per axis)
PROFILES = {
    "spatial": ((0.4, 0.3, 0.3), ("fast", "all", "all")),
    "temporal": ((0.2, 0.4, 0.4), ("slow", "fast", "fast")),
    "global": ((1 / 3, 1 / 3, 1 / 3), ("slow", "slow", "slow")),
    "local": ((1 / 3, 1 / 3, 1 / 3), ("fast", "fast", "fast")),
    "near_global": ((1 / 3, 1 / 3, 1 / 3), ("slow", "slow", "slow")),
}
#: content norm factor per head type (``near_global`` heads at a third of the drawn norm)
NORM_FACTOR = {"near_global": 1 / 3}
VALUE_KINDS = ("iid", "smooth")


@dataclasses.dataclass(frozen=True)
class StructuredSpec:
    """Parameters of :func:`structured_qkv` (see the module docstring)."""

    video_shape: tuple
    heads: int
    head_dim: int = 128
    content_norm: tuple = (10.0, 16.0)
    noise: float = 1.0
    types: tuple = ("spatial", "temporal", "spatial", "temporal", "global")
    sinks: int = 4
    sink_align: float = 3.0
    sink_gain: float = 0.35
    seed: int = 0
    values: str = "iid"
    smooth_scale: float = 3.0

    def head_type(self, h: int) -> str:
        return self.types[h % len(self.types)]


def rope_pair_axes(head_dim: int) -> list[tuple[int, int]]:
    """``[(axis, rank)]`` per rotated channel pair of Wan's RoPE: axis 0/1/2 = t/h/w, rank 0 the
    fastest frequency of that axis (pairs in the order of
    :func:`~ditattn.models.wan.embeddings.rope_tables`)."""
    hw = 2 * (head_dim // 6)
    dims = (head_dim - 2 * hw, hw, hw)
    return [(axis, r) for axis, d in enumerate(dims) for r in range(d // 2)]


def content_vector(spec: StructuredSpec, head: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``(a [D], sink direction e [D])`` of one head (float64, CPU)."""
    D = spec.head_dim
    pairs = rope_pair_axes(D)
    counts = [sum(1 for a, _ in pairs if a == ax) for ax in range(3)]
    fracs, bands = PROFILES[spec.head_type(head)]
    energy = torch.zeros(D // 2, dtype=torch.float64)
    for p, (ax, r) in enumerate(pairs):
        n = counts[ax]
        third = max(1, n // 3)
        band = bands[ax]
        if band == "all" or (band == "fast" and r < third) or (band == "slow" and r >= n - third):
            energy[p] = 1.0
    for ax in range(3):  # the axis' share, spread evenly over its band
        idx = [p for p, (a, _) in enumerate(pairs) if a == ax]
        tot = float(energy[idx].sum())
        if tot > 0:
            energy[idx] *= fracs[ax] / tot
    phase = torch.rand(D // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    amp = energy.sqrt()
    a = torch.stack([amp * phase.cos(), amp * phase.sin()], dim=-1).flatten()
    slow = [max(p for p, (a_, _) in enumerate(pairs) if a_ == ax) for ax in range(3)]
    e = torch.zeros(D, dtype=torch.float64)
    for p in slow:
        e[2 * p] = 1.0
    e /= e.norm()
    lo, hi = spec.content_norm
    norm = lo + (hi - lo) * float(torch.rand(1, generator=gen, dtype=torch.float64))
    norm *= NORM_FACTOR.get(spec.head_type(head), 1.0)
    a = a / a.norm() * math.sqrt(max(norm**2 - spec.sink_align**2, 1.0)) + spec.sink_align * e
    return a, e


def sink_positions(seq_len: int, n: int) -> list[int]:
    """Token 0 and ``n - 1`` more evenly spaced tokens (``n`` sinks; none for ``n = 0``)."""
    if n <= 0:
        return []
    return sorted({0, *(int(round(i * seq_len / n)) for i in range(1, n))} - {seq_len})


def structured_qkv(
    spec: StructuredSpec, *, device="cpu", dtype=torch.bfloat16, batch: int = 1
) -> tuple[Tensor, Tensor, Tensor, dict]:
    """Structured q, k, v ``[batch, T*H*W, heads, head_dim]`` in ``dtype`` on ``device`` (video
    tokens in T-major order, as the Wan DiT lays them out) and an info dict (``head_types``,
    ``sinks``, ``content_norms``).  Deterministic in ``spec.seed``."""
    from ditattn.models.fused import apply_rope
    from ditattn.models.wan.embeddings import rope_tables

    T, H, W = (int(x) for x in spec.video_shape)
    S, D = T * H * W, spec.head_dim
    dev = torch.device(device)
    cos, sin = rope_tables(D, (T, H, W), dev)
    gen = torch.Generator().manual_seed(spec.seed)
    dgen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
    q = torch.empty(batch, S, spec.heads, D, dtype=dtype, device=dev)
    k, v = torch.empty_like(q), torch.empty_like(q)
    sinks = sink_positions(S, spec.sinks)
    norms = []
    for h in range(spec.heads):
        a, e = content_vector(spec, h, gen)
        norms.append(float(a.norm()))
        a32, e32 = a.to(dev, torch.float32), e.to(dev, torch.float32)
        qh = a32 + spec.noise * torch.randn(batch, S, 1, D, generator=dgen, device=dev)
        kh = a32 + spec.noise * torch.randn(batch, S, 1, D, generator=dgen, device=dev)
        if sinks:
            gain = spec.sink_gain * float(a.norm()) ** 2 / spec.sink_align
            kh[:, sinks] += gain * e32
        q[:, :, h : h + 1] = apply_rope(qh, cos, sin).to(dtype)
        k[:, :, h : h + 1] = apply_rope(kh, cos, sin).to(dtype)
        if spec.values == "smooth":
            v[:, :, h : h + 1] = smooth_field(batch, (T, H, W), D, spec.smooth_scale, dgen, dev).to(dtype)
        elif spec.values == "iid":
            v[:, :, h : h + 1] = torch.randn(batch, S, 1, D, generator=dgen, device=dev).to(dtype)
        else:
            raise ValueError(f"values must be one of {list(VALUE_KINDS)}, got {spec.values!r}")
    info = {"head_types": [spec.head_type(h) for h in range(spec.heads)], "sinks": sinks, "content_norms": norms}
    return q, k, v, info


def smooth_field(batch: int, grid: Sequence[int], dim: int, scale: float, gen: torch.Generator, device) -> Tensor:
    """A spatially smooth value field ``[batch, T*H*W, 1, dim]`` (float32, T-major tokens): Gaussian
    noise low-pass filtered over the grid (Gaussian kernel of ``scale`` cells per axis, applied in
    the Fourier domain), normalised per channel to unit variance, plus 0.1 of i.i.d. noise."""
    T, H, W = (int(x) for x in grid)
    x = torch.randn(batch, dim, T, H, W, generator=gen, device=device)
    f = torch.fft.fftn(x, dim=(2, 3, 4))
    freqs = [torch.fft.fftfreq(n, device=device) for n in (T, H, W)]
    ft, fh, fw = torch.meshgrid(*freqs, indexing="ij")
    f *= torch.exp(-2 * (math.pi * scale) ** 2 * (ft**2 + fh**2 + fw**2))
    y = torch.fft.ifftn(f, dim=(2, 3, 4)).real
    y = (y - y.mean((2, 3, 4), keepdim=True)) / y.std((2, 3, 4), keepdim=True).clamp(min=1e-6)
    y = y + 0.1 * torch.randn(y.shape, generator=gen, device=device)
    return y.flatten(2).transpose(1, 2).unsqueeze(2)


#: named structured families: keyword arguments of :class:`StructuredSpec` on top of the grid,
#: heads and seed
FAMILIES = {
    "original": {},
    "weak": {"content_norm": (3.0, 8.0)},
    "mixed": {"types": ("local", "near_global", "local", "spatial", "near_global", "temporal")},
    "smooth": {"values": "smooth"},
    "weak_mixed_smooth": {
        "content_norm": (3.0, 8.0),
        "values": "smooth",
        "types": ("local", "near_global", "spatial", "near_global", "temporal", "local"),
    },
}


def family_spec(
    family: str, video_shape: Sequence[int], heads: int, *, head_dim: int = 128, seed: int = 0
) -> StructuredSpec:
    """The :class:`StructuredSpec` of a named family (:data:`FAMILIES`)."""
    try:
        kw = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown structured family {family!r}; known: {', '.join(FAMILIES)}") from None
    return StructuredSpec(
        video_shape=tuple(int(x) for x in video_shape), heads=int(heads), head_dim=int(head_dim), seed=int(seed), **kw
    )


def attention_profile(
    q: Tensor, k: Tensor, video_shape: Sequence[int], rows: Optional[Tensor] = None, scale: Optional[float] = None
) -> dict:
    """Where the attention of ``rows`` (default: 64 evenly spaced queries) goes, per head (float32
    exact): ``same_frame`` (mass on keys in the query's frame), ``near`` (keys within Chebyshev
    distance 1 in (t, h, w)), ``same_place`` (keys at the query's (h, w) in any frame) and
    ``top1_percent`` (mass of the 1 % largest weights of the row).  Each ``[heads]`` float."""
    T, H, W = (int(x) for x in video_shape)
    S, D = q.shape[1], q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    rows = torch.linspace(0, S - 1, min(64, S)).round().long() if rows is None else rows
    idx = torch.arange(S)
    t, hh, ww = idx // (H * W), (idx // W) % H, idx % W
    qt, qh, qw = t[rows], hh[rows], ww[rows]
    same_frame = t[None, :] == qt[:, None]
    near = (
        ((t[None] - qt[:, None]).abs() <= 1)
        & ((hh[None] - qh[:, None]).abs() <= 1)
        & ((ww[None] - qw[:, None]).abs() <= 1)
    )
    same_place = (hh[None] == qh[:, None]) & (ww[None] == qw[:, None])
    out = {"same_frame": [], "near": [], "same_place": [], "top1_percent": []}
    top = max(1, S // 100)
    for h in range(q.shape[2]):
        s = (q[0, rows.to(q.device), h].float() @ k[0, :, h].float().T).cpu() * scale
        p = torch.softmax(s, dim=-1)
        out["same_frame"].append(float((p * same_frame).sum(-1).mean()))
        out["near"].append(float((p * near).sum(-1).mean()))
        out["same_place"].append(float((p * same_place).sum(-1).mean()))
        out["top1_percent"].append(float(p.topk(top, dim=-1).values.sum(-1).mean()))
    return out
