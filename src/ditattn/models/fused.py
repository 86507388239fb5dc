"""Fused elementwise work around the attention of a DiT block: Triton on CUDA, PyTorch elsewhere.

A Wan block spends, besides its GEMMs and attention, a handful of memory-bound passes over the
``[batch, tokens, width]`` activations (gated residual adds, float32 layer norms with adaLN
modulation, per-tensor RMSNorm of q and k, 3-D RoPE).  Unfused (eager PyTorch) each is several
kernels with float32 intermediates in memory; here each group is ONE pass over the rows:

* :func:`residual_norm` -- ``x' = x + y * gate`` then ``h = LN(x') * (1 + scale) + shift`` (or an
  affine LN, or no norm), returning ``(x', h)``;
* :func:`qk_norm_rope` -- RMSNorm of q and of k over the full width (all heads), then RoPE on
  interleaved channel pairs, returning ``(q', k')``.

Numerics follow the PyTorch reference (which matches diffusers' Wan): float32 arithmetic, with
results rounded to the activation dtype exactly where the reference rounds (after the residual
add, after the norm, after the RMSNorm and after the rotation).  The Triton kernels run on CUDA
tensors (and on CPU tensors under ``TRITON_INTERPRET=1`` for tests); every other case runs the
reference.  Both are registered as ``torch.library`` custom ops, so ``torch.compile`` keeps each
as one opaque call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

try:  # Triton is optional (CPU-only installs may lack it); the reference always works
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False


def _interpreting() -> bool:
    from ditattn.attention.kernels import interpreting

    return interpreting()


def _use_triton(*tensors: Tensor, impl: str) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise AttentionConfigError(f"fused op impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":  # the interpreter is for tests: "auto" on CPU tensors is the reference
        return _HAVE_TRITON and tensors[0].is_cuda
    if not (_HAVE_TRITON and (tensors[0].is_cuda or _interpreting())):
        raise AttentionConfigError("fused op impl='triton' needs Triton and CUDA tensors (or TRITON_INTERPRET=1)")
    from ditattn.attention.kernels import check_device

    check_device(*tensors, what="fused op impl='triton'")  # on CPU: the interpreter's bf16/fp8 fixes
    return True


def _rows(t: Optional[Tensor], B: int, S: int, N: int, what: str) -> tuple[Tensor, int, int]:
    """A per-row float32 operand broadcast to ``[B, S, N]``: ``(tensor, batch stride, token stride)``."""
    if t is None:
        return None, 0, 0
    try:
        e = t.expand(B, S, N)
    except RuntimeError:
        raise AttentionConfigError(f"{what} of shape {tuple(t.shape)} does not broadcast to [{B}, {S}, {N}]") from None
    if e.stride(-1) != 1:
        e = e.contiguous()
    return e, e.stride(0), e.stride(1)


# ------------------------------------------------------------------------------------------------
# residual add + layer norm (+ adaLN modulation)


def residual_norm_reference(
    x: Tensor,
    y: Optional[Tensor],
    gate: Optional[Tensor],
    *,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-6,
    norm: bool = True,
) -> tuple[Tensor, Optional[Tensor]]:
    """PyTorch reference of :func:`residual_norm` (same contract)."""
    if y is not None:
        x = (x.float() + (y.float() * gate if gate is not None else y.float())).to(x.dtype)
    if not norm:
        return x, None
    n = x.shape[-1]
    h = F.layer_norm(
        x.float(),
        (n,),
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None,
        eps,
    )
    if scale is not None:
        h = h * (1 + scale.float())
    if shift is not None:
        h = h + shift.float()
    return x, h.to(x.dtype)


if _HAVE_TRITON:

    @triton.jit
    def _residual_norm_kernel(
        X,
        Y,
        G,
        SC,
        SH,
        W,
        Bi,
        XO,
        HO,
        S,
        N,
        eps,
        sgb,
        sgs,
        scb,
        scs,
        shb,
        shs,
        HAS_Y: tl.constexpr,
        HAS_G: tl.constexpr,
        NORM: tl.constexpr,
        HAS_SC: tl.constexpr,
        HAS_SH: tl.constexpr,
        HAS_W: tl.constexpr,
        HAS_B: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        b = row // S
        s = row % S
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + row * N + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(Y + row * N + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_G:
                y = y * tl.load(G + b * sgb + s * sgs + offs, mask=m, other=0.0)
            xr = (x + y).to(XO.dtype.element_ty)
            tl.store(XO + row * N + offs, xr, mask=m)
            x = xr.to(tl.float32)
        if NORM:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(m, x - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
            h = xc * rstd
            if HAS_W:
                h = h * tl.load(W + offs, mask=m, other=0.0)
            if HAS_B:
                h = h + tl.load(Bi + offs, mask=m, other=0.0)
            if HAS_SC:
                h = h * (1.0 + tl.load(SC + b * scb + s * scs + offs, mask=m, other=0.0))
            if HAS_SH:
                h = h + tl.load(SH + b * shb + s * shs + offs, mask=m, other=0.0)
            tl.store(HO + row * N + offs, h.to(HO.dtype.element_ty), mask=m)


def _residual_norm_triton(x, y, gate, scale, shift, weight, bias, eps, norm):
    B, S, N = x.shape
    x = x.contiguous()
    y = y.contiguous() if y is not None else None
    g, sgb, sgs = _rows(gate.float() if gate is not None else None, B, S, N, "gate")
    sc, scb, scs = _rows(scale.float() if scale is not None else None, B, S, N, "scale")
    sh, shb, shs = _rows(shift.float() if shift is not None else None, B, S, N, "shift")
    w = weight.float().contiguous() if weight is not None else None
    bi = bias.float().contiguous() if bias is not None else None
    xo = torch.empty_like(x) if y is not None else x
    ho = torch.empty_like(x) if norm else x
    block = triton.next_power_of_2(N)
    dummy = x
    _residual_norm_kernel[(B * S,)](
        x,
        y if y is not None else dummy,
        g if g is not None else dummy,
        sc if sc is not None else dummy,
        sh if sh is not None else dummy,
        w if w is not None else dummy,
        bi if bi is not None else dummy,
        xo,
        ho,
        S,
        N,
        eps,
        sgb,
        sgs,
        scb,
        scs,
        shb,
        shs,
        HAS_Y=y is not None,
        HAS_G=g is not None,
        NORM=norm,
        HAS_SC=sc is not None,
        HAS_SH=sh is not None,
        HAS_W=w is not None,
        HAS_B=bi is not None,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )
    return xo, (ho if norm else None)


@torch.library.custom_op("ditattn::residual_norm", mutates_args=())
def _residual_norm_op(
    x: Tensor,
    y: Optional[Tensor],
    gate: Optional[Tensor],
    scale: Optional[Tensor],
    shift: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    norm: bool,
    use_triton: bool,
) -> tuple[Tensor, Tensor]:
    if use_triton:
        xo, ho = _residual_norm_triton(x, y, gate, scale, shift, weight, bias, eps, norm)
    else:
        xo, ho = residual_norm_reference(
            x, y, gate, scale=scale, shift=shift, weight=weight, bias=bias, eps=eps, norm=norm
        )
    # a custom op may not return an input or None: an empty tensor stands for "x unchanged" / "no norm"
    return (xo if y is not None else x.new_empty(0)), (ho if norm else x.new_empty(0))


@_residual_norm_op.register_fake
def _(x, y, gate, scale, shift, weight, bias, eps, norm, use_triton):
    return (torch.empty_like(x) if y is not None else x.new_empty(0)), (
        torch.empty_like(x) if norm else x.new_empty(0)
    )


def residual_norm(
    x: Tensor,
    y: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    *,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-6,
    norm: bool = True,
    impl: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated residual add then layer norm with adaLN modulation, in one pass over the rows.

    Args:
        x: residual stream ``[B, S, N]`` (bf16/fp16/fp32).
        y: branch output ``[B, S, N]`` in x's dtype, or None (no residual add).
        gate: float32, broadcastable to ``[B, S, N]`` (``[B, 1, N]`` per sample or ``[B, S, N]`` per
            token), multiplies ``y``; None means 1.
        scale, shift: adaLN modulation, float32 broadcastable to ``[B, S, N]``: ``h = LN(x') * (1 +
            scale) + shift``; None leaves that term out.
        weight, bias: affine LN parameters ``[N]`` (computed in float32), or None.
        norm: False returns ``(x', None)`` without the norm.
        impl: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns ``(x', h)``: ``x' = x + y * gate`` rounded to x's dtype (x itself when y is None) and ``h``
    in x's dtype, computed in float32 from the ROUNDED ``x'`` (LN without affine unless weight/bias).
    """
    if x.dim() != 3:
        raise AttentionConfigError(f"residual_norm: x must be [batch, tokens, width], got shape {tuple(x.shape)}")
    if y is not None and (y.shape != x.shape or y.dtype != x.dtype):
        raise AttentionConfigError(
            f"residual_norm: y must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(y.shape)}, {y.dtype}"
        )
    if not norm and y is None:
        return x, None
    xo, ho = _residual_norm_op(
        x, y, gate, scale, shift, weight, bias, float(eps), bool(norm), _use_triton(x, impl=impl)
    )
    return (xo if y is not None else x), (ho if norm else None)


# ------------------------------------------------------------------------------------------------
# q/k RMSNorm (across heads) + RoPE


def qk_norm_rope_reference(
    q: Tensor,
    k: Tensor,
    wq: Optional[Tensor],
    wk: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    eps: float,
    head_dim: int,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of :func:`qk_norm_rope` (same contract)."""
    n = q.shape[-1]

    c, s = cos.reshape(1, -1, 1, head_dim // 2), sin.reshape(1, -1, 1, head_dim // 2)
    one = lambda x, w: apply_rope(F.rms_norm(x, (n,), w, eps).unflatten(-1, (-1, head_dim)), c, s).flatten(-2)
    return one(q, wq), one(k, wk)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved channel pairs ``(x[2i], x[2i+1])`` of ``x [B, S, heads, D]`` by the angles
    ``cos``/``sin`` (float32, broadcastable to ``[B, S, heads, D // 2]``); computed in float32, result
    in x's dtype."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


if _HAVE_TRITON:

    @triton.jit
    def _qk_norm_rope_kernel(
        Q, K, WQ, WK, COS, SIN, QO, KO, S, N, eps, HALF_D: tl.constexpr, HAS_W: tl.constexpr, BLOCK_P: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        s = row % S
        p = tl.arange(0, BLOCK_P)  # channel-pair index within the row
        m = p < N // 2
        c = tl.load(COS + s * HALF_D + p % HALF_D, mask=m, other=0.0)
        sn = tl.load(SIN + s * HALF_D + p % HALF_D, mask=m, other=0.0)
        if which == 0:
            X, W, O = Q, WQ, QO
        else:
            X, W, O = K, WK, KO
        xe = tl.load(X + row * N + 2 * p, mask=m, other=0.0).to(tl.float32)
        xo = tl.load(X + row * N + 2 * p + 1, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)) / N + eps)
        ye = xe * r
        yo = xo * r
        if HAS_W:
            ye = ye * tl.load(W + 2 * p, mask=m, other=0.0).to(tl.float32)
            yo = yo * tl.load(W + 2 * p + 1, mask=m, other=0.0).to(tl.float32)
        ye = ye.to(O.dtype.element_ty).to(tl.float32)  # the reference rounds the normed q/k first
        yo = yo.to(O.dtype.element_ty).to(tl.float32)
        tl.store(O + row * N + 2 * p, (ye * c - yo * sn).to(O.dtype.element_ty), mask=m)
        tl.store(O + row * N + 2 * p + 1, (ye * sn + yo * c).to(O.dtype.element_ty), mask=m)


def _qk_norm_rope_triton(q, k, wq, wk, cos, sin, eps, head_dim):
    B, S, N = q.shape
    q, k = q.contiguous(), k.contiguous()
    cos, sin = cos.float().reshape(S, head_dim // 2).contiguous(), sin.float().reshape(S, head_dim // 2).contiguous()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    has_w = wq is not None
    _qk_norm_rope_kernel[(B * S, 2)](
        q,
        k,
        wq.contiguous() if has_w else q,
        wk.contiguous() if has_w else k,
        cos,
        sin,
        qo,
        ko,
        S,
        N,
        eps,
        HALF_D=head_dim // 2,
        HAS_W=has_w,
        BLOCK_P=triton.next_power_of_2(N // 2),
        num_warps=4,
    )
    return qo, ko


@torch.library.custom_op("ditattn::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    q: Tensor,
    k: Tensor,
    wq: Optional[Tensor],
    wk: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    eps: float,
    head_dim: int,
    use_triton: bool,
) -> tuple[Tensor, Tensor]:
    if use_triton:
        return _qk_norm_rope_triton(q, k, wq, wk, cos, sin, eps, head_dim)
    return qk_norm_rope_reference(q, k, wq, wk, cos, sin, eps, head_dim)


@_qk_norm_rope_op.register_fake
def _(q, k, wq, wk, cos, sin, eps, head_dim, use_triton):
    return torch.empty_like(q), torch.empty_like(k)


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    wq: Optional[Tensor],
    wk: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    *,
    eps: float,
    head_dim: int,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """RMSNorm over the whole width of q and of k, then rotary embedding, in one pass.

    Args:
        q, k: ``[B, S, N]`` projections (``N = heads * head_dim``), same shape and dtype.
        wq, wk: RMSNorm weights ``[N]`` (or both None: no weight).
        cos, sin: float32 rotary tables with ``S * head_dim // 2`` entries (``[1, S, 1, head_dim//2]``
            from :func:`ditattn.models.wan.embeddings.rope_tables`), one angle per channel pair.
        eps: RMSNorm epsilon.  head_dim: channels per head (even).
        impl: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns ``(q', k')`` ``[B, S, N]`` in the input dtype: ``rope(round(rms_norm(x) * w))`` with pairs
    ``(x[2i], x[2i+1])`` of each head rotated by angle ``i`` of the token, computed in float32.
    """
    if q.dim() != 3 or q.shape != k.shape or q.dtype != k.dtype:
        raise AttentionConfigError(
            f"qk_norm_rope: q and k must be [batch, tokens, width] of one shape and dtype, got "
            f"{tuple(q.shape)} {q.dtype} and {tuple(k.shape)} {k.dtype}"
        )
    if head_dim % 2 or q.shape[-1] % head_dim:
        raise AttentionConfigError(
            f"qk_norm_rope: width {q.shape[-1]} is not a multiple of the even head_dim {head_dim}"
        )
    if cos.numel() != q.shape[1] * head_dim // 2 or sin.numel() != cos.numel():
        raise AttentionConfigError(
            f"qk_norm_rope: rotary tables must hold tokens * head_dim/2 = {q.shape[1] * head_dim // 2} angles, "
            f"got {cos.numel()} and {sin.numel()}"
        )
    if (wq is None) != (wk is None):
        raise AttentionConfigError("qk_norm_rope: give both RMSNorm weights or neither")
    return _qk_norm_rope_op(q, k, wq, wk, cos, sin, float(eps), int(head_dim), _use_triton(q, impl=impl))
