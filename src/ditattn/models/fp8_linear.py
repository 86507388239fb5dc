"""FP8 linears with a fused per-row activation quantizer (``--dit-quantization fp8``).

torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` quantizes each weight
once (e4m3, one float32 scale per output channel) and, in eager mode, each activation with several
PyTorch ops on every call (absmax, scale, divide, clamp, cast: about 235 ms of a 601 ms Wan2.1-1.3B
480p step on the H200, against 58 ms of FP8 GEMMs), once per linear even where several linears read
the same input (self-attention q/k/v), and without the feed-forward's GELU epilogue.  Here:

* :func:`quantize_rows` -- ONE pass per row of a bf16 ``[M, K]`` activation: absmax, scale, divide,
  clamp, cast to float8_e4m3fn (Triton on CUDA; the PyTorch reference of the same formula
  elsewhere); ``gelu=True`` applies the feed-forward's tanh-GELU first, in the same pass, so the
  first feed-forward GEMM writes its bias-added output and the second's quantizer does the GELU.
* :func:`fp8_linears` / :func:`fp8_linear` -- quantize an input once, then ``torch._scaled_mm``
  (the PyTorch op torchao calls, same operands: torchao's weight ``qdata`` / ``scale``, row-wise
  activation scales, bias, bfloat16 output, torchao's ``use_fast_accum``) for every linear that reads
  it.  A linear :func:`mark_fused` did not mark -- a LoRA adapter wrapping the weight, a torchao
  layout other than per-row e4m3 -- runs through its module (torchao's own path); the quantization
  plan lists those.

Numerics match torchao 0.16's per-row activation quantization (``_choose_scale_float8`` +
``_quantize_affine_float8``, its torch kernel): ``scale = absmax / 448`` computed in the activation
dtype (so rounded to bfloat16) then float32, ``q = e4m3(clamp(x / scale, -448, 448))`` with an IEEE
division and round-to-nearest-even.  One difference: the absmax is floored at :data:`EPS` (448 x
2^-126, about 5.3e-36, so the scale is at least the smallest normal float32), so an all-zero row
gives zeros (torchao's scale is 0 there and its row becomes NaN) and a row whose absmax is below
5.3e-36 (where torchao's scale would be subnormal) is quantized against that floor.

How the Triton kernel gets there (the contract is :func:`quantize_rows`'):

* It divides once per row, ``inv = 1 / scale`` (IEEE), and multiplies each element, ``x * inv``,
  rounding the product's float32 bits to 17 significant bits (``(bits + 0x40) & ~0x7f``) before the
  e4m3 cast (no clamp: ``|x * inv| < 449`` within a row, which the cast rounds to 448).  That
  gives the IEEE quotient's code for every finite bf16 ``x`` and bf16 ``scale``: both have 8
  significant bits and an e4m3 rounding midpoint ``m`` at most 5, so ``x / scale``
  either equals ``m`` (``x = m * scale`` exactly) or lies at least 2^-13 (relative) from it;
  ``x * inv`` is within 2^-22.9 of ``x / scale`` and the 17-bit rounding moves it at most 2^-17,
  so it lands exactly on ``m`` in the first case (the cast then rounds half to even, as on the
  quotient) and never crosses ``m`` in the second.  Checked exhaustively: every finite bf16 ``x``
  against every positive normal bf16 ``scale`` with ``|x / scale| < 449`` (1.1e9 pairs) gives the
  quotient's code; the plain product would round 1.6e-5 of them -- exact ties -- to the odd
  neighbour (tests cover all ``x`` at 11 scale exponents x 128 mantissas, and rows of exact ties).
* ``gelu=True`` computes the tanh-GELU as ``x * sigmoid(2u) = x / (1 + 2^t)``, ``t = -2 log2(e) u =
  x (GELU_C1 + GELU_C2 x^2)`` (``u = sqrt(2/pi) (x + 0.044715 x^3)``) in float32 -- on CUDA with
  the approximate ``ex2.approx.ftz`` and ``div.full`` (2 ulp each) -- rounded to bf16 before its
  absmax, as ``F.gelu`` then quantize would: :func:`gelu_bf16`.  For every finite bf16 input it is
  within one bf16 step of the correctly rounded tanh-GELU (float64), or within 2^-124 of it
  (results below that: float32 subnormals, and ``2^t`` overflows for x < -10 so those flush to
  -0); tested on all 65,280 inputs.  Those bf16 values are then quantized exactly as above.
  PyTorch's ``0.5 x (1 + tanh u)`` in float32 is no closer to the float64 GELU (its ``1 + tanh u``
  cancels for negative x: absolute error up to 3.3e-7, 145 bf16 inputs below x = -4.5 more than a
  bf16 step off), so the codes differ from ``F.gelu`` then quantize by at most one e4m3 step, on
  few elements, on rows of absmax >= 1 (the feed-forward's hidden rows).
* Rows up to :data:`ONE_PASS_MAX` wide are read once and held in registers (several narrow rows per
  program, up to three power-of-two column tiles per row: :func:`row_tiles`); wider rows are read
  twice (absmax, then quantize).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

try:  # Triton is optional (CPU-only installs may lack it); the reference always works
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
#: floor of a row's absmax: 448 x the smallest normal float32, so the scale is at least that normal
#: number (an all-zero row quantizes to zeros instead of torchao's NaN; any row whose torchao scale
#: is a normal number quantizes exactly as torchao's)
EPS = 448.0 * 2.0**-126
#: the module attribute :func:`mark_fused` sets on a linear whose activations take the fused path
FUSED_ATTR = "fp8_fused_activation"


# ------------------------------------------------------------------------------------------------
# the quantizer


def quantize_rows_reference(x: Tensor, *, gelu: bool = False, eps: float = EPS) -> tuple[Tensor, Tensor]:
    """PyTorch reference of :func:`quantize_rows` (same contract, several ops)."""
    x = x.reshape(-1, x.shape[-1])
    if gelu:
        x = F.gelu(x, approximate="tanh")
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=eps)
    scale = (amax / E4M3_MAX).to(x.dtype).float()  # torchao computes the scale in the activation dtype
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


#: rows up to this width are held in registers, ``ROWS`` rows per program (read once; a feed-forward
#: row's GELU computed once); wider rows loop over LOOP_BLOCK-wide chunks twice, absmax then quantize
#: (the second read hits L2, the GELU is computed again)
ONE_PASS_MAX = 16384
LOOP_BLOCK = 2048
#: a program of narrow rows takes as many rows (a power of two) as fit in this many elements
ROW_TILE_ELEMS = 8192
#: tanh-GELU as x * sigmoid(2u) = x / (1 + 2^t), t = -2 log2(e) u = x (GELU_C1 + GELU_C2 x^2) with
#: u = sqrt(2/pi) (x + 0.044715 x^3)
GELU_C1 = -2.0 * 1.4426950408889634 * 0.7978845608028654
GELU_C2 = GELU_C1 * 0.044715
#: the product ``x * (1 / scale)``'s float32 bits are rounded to 17 significant bits (``(bits +
#: SNAP_HALF) & SNAP_MASK``) before the e4m3 cast, which then rounds as on ``x / scale`` (module docstring)
SNAP_HALF = 0x40
SNAP_MASK = -0x80


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)  # pure, a handful of widths per model
def row_tiles(k: int) -> tuple[int, int, int]:
    """The one-pass kernel's column tiles ``(B0, B1, B2)`` for rows of width ``k <= ONE_PASS_MAX``:
    powers of two (B1, B2 may be 0 = absent) whose sum covers ``k`` with little padding -- 1536 =
    1024 + 512, 5120 = 4096 + 1024, 8960 = 8192 + 512 + 512, 13824 = 8192 + 4096 + 2048 (one
    ``next_power_of_2(k)`` tile would mask 25 %, 20 %, 45 % and 16 % of the lanes there).  Tiles
    narrower than 512 are used only for rows narrower than 512."""
    if k <= 512:
        return _next_pow2(k), 0, 0
    tiles, rest = [], k
    while rest > 0 and len(tiles) < 2:
        b = 1 << (rest.bit_length() - 1)  # the largest power of two <= rest
        if b < 512:
            break
        tiles.append(b)
        rest -= b
    if rest > 0:
        tiles.append(max(512, _next_pow2(rest)))
    return tuple(tiles + [0] * (3 - len(tiles)))


def launch_config(m: int, k: int) -> dict:
    """Default launch of the quantizer kernel for ``m`` rows of width ``k``: ``rows`` per program
    (a power of two, rows up to :data:`ONE_PASS_MAX` wide only) and ``num_warps`` (8, or 4 for
    programs of at most 2048 elements).  Chosen from the SASS (sm_90, compiled offline with Triton
    3.6: 8 warps issue ~25 instructions per element of the 8960-wide GELU rows where 16 warps
    issue ~32, for the reductions' fixed cost); ``bench/fp8_quant_kernel.py --sweep`` times the
    alternatives on the GPU."""
    rows, num_warps = _launch_config(m, k)
    return {"rows": rows, "num_warps": num_warps}


@functools.lru_cache(maxsize=256)  # called for every quantized GEMM input: the arithmetic once per shape
def _launch_config(m: int, k: int) -> tuple[int, int]:
    if k > ONE_PASS_MAX:
        return 1, 8
    width = sum(row_tiles(k))
    rows = 1
    while rows * 2 * width <= ROW_TILE_ELEMS and rows < m:
        rows *= 2
    return rows, 4 if rows * width <= 2048 else 8


if _HAVE_TRITON:
    _C1, _C2 = tl.constexpr(GELU_C1), tl.constexpr(GELU_C2)
    _SNAP_HALF, _SNAP_MASK = tl.constexpr(SNAP_HALF), tl.constexpr(SNAP_MASK)

    @triton.jit
    def gelu_bf16(x):
        """tanh-GELU of a bf16 tensor rounded to bf16, as ``x / (1 + 2^t)``, ``t = x (GELU_C1 + GELU_C2
        x^2)`` in float32: within one bf16 step (or 2^-124) of the correctly rounded value (module docstring)."""
        xf = x.to(tl.float32)
        t = xf * (xf * xf * _C2 + _C1)
        return (xf / (1.0 + tl.exp2(t))).to(tl.bfloat16)

    @triton.jit
    def _load(Xr, cols, row_ok, K):
        """``[ROWS, len(cols)]`` bf16 activations, 0 outside the rows."""
        return tl.load(Xr + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < K), other=0.0)

    @triton.jit
    def _act(x, GELU: tl.constexpr):
        return gelu_bf16(x) if GELU else x

    @triton.jit
    def _absmax(x):
        return tl.max(tl.abs(x.to(tl.float32)), axis=1)

    @triton.jit
    def _store_q(Qr, cols, row_ok, K, x, inv):
        """e4m3(x * inv) with the product rounded to 17 significant bits first, which makes the cast
        round exactly as on the IEEE quotient x / scale (module docstring).  No clamp: |x| <= absmax
        and scale >= absmax / 448 (1 - 2^-9), so |x * inv| < 449, which rounds to 448 (and on CUDA
        the cast saturates anyway)."""
        q = x.to(tl.float32) * inv[:, None]
        q = ((q.to(tl.int32, bitcast=True) + _SNAP_HALF) & _SNAP_MASK).to(tl.float32, bitcast=True)
        tl.store(
            Qr + cols[None, :],
            q.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
            mask=row_ok[:, None] & (cols[None, :] < K),
        )

    @triton.jit
    def _quantize_rows_kernel(
        X,
        Q,
        S,
        M,
        K,
        stride_x,
        eps,
        GELU: tl.constexpr,
        ROWS: tl.constexpr,
        B0: tl.constexpr,
        B1: tl.constexpr,
        B2: tl.constexpr,
        LOOP: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        Xr = X + rows[:, None] * stride_x
        Qr = Q + rows[:, None] * K
        c0 = tl.arange(0, B0)
        if LOOP:  # rows wider than ONE_PASS_MAX: absmax over chunks, then quantize them (re-read)
            acc = tl.zeros([ROWS, B0], dtype=tl.float32)
            for k0 in range(0, K, B0):
                acc = tl.maximum(acc, tl.abs(_act(_load(Xr, k0 + c0, row_ok, K), GELU).to(tl.float32)))
            amax = tl.max(acc, axis=1)
        else:  # the rows held in registers, in up to three tiles of power-of-two width, all loads first
            x0 = _load(Xr, c0, row_ok, K)
            if B1 > 0:
                c1 = B0 + tl.arange(0, B1)
                x1 = _load(Xr, c1, row_ok, K)
            if B2 > 0:
                c2 = B0 + B1 + tl.arange(0, B2)
                x2 = _load(Xr, c2, row_ok, K)
            x0 = _act(x0, GELU)
            amax = _absmax(x0)
            if B1 > 0:
                x1 = _act(x1, GELU)
                amax = tl.maximum(amax, _absmax(x1))
            if B2 > 0:
                x2 = _act(x2, GELU)
                amax = tl.maximum(amax, _absmax(x2))
        # the scale in the activation dtype (torchao: bf16 absmax / 448), then float32; its reciprocal
        scale = tl.div_rn(tl.maximum(amax, eps), 448.0).to(tl.bfloat16).to(tl.float32)
        inv = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        if LOOP:
            for k0 in range(0, K, B0):
                _store_q(Qr, k0 + c0, row_ok, K, _act(_load(Xr, k0 + c0, row_ok, K), GELU), inv)
        else:
            _store_q(Qr, c0, row_ok, K, x0, inv)
            if B1 > 0:
                _store_q(Qr, c1, row_ok, K, x1, inv)
            if B2 > 0:
                _store_q(Qr, c2, row_ok, K, x2, inv)
        tl.store(S + rows, scale, mask=row_ok)


def _quantize_rows_triton(
    x: Tensor, gelu: bool, eps: float, *, rows: Optional[int] = None, num_warps: Optional[int] = None
) -> tuple[Tensor, Tensor]:
    """The kernel's launch; ``rows`` / ``num_warps`` override :func:`launch_config` (benchmarks)."""
    from ditattn.attention.kernels import check_device

    check_device(x, what="fp8 activation quantizer")
    M, K = x.shape
    q = torch.empty(M, K, dtype=E4M3, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        cfg = launch_config(M, K)
        rows = rows or cfg["rows"]
        loop = K > ONE_PASS_MAX
        b0, b1, b2 = (LOOP_BLOCK, 0, 0) if loop else row_tiles(K)
        _quantize_rows_kernel[(triton.cdiv(M, rows),)](
            x,
            q,
            scale,
            M,
            K,
            x.stride(0),
            eps,
            GELU=gelu,
            ROWS=rows,
            B0=b0,
            B1=b1,
            B2=b2,
            LOOP=loop,
            num_warps=num_warps or cfg["num_warps"],
        )
    return q, scale


@torch.library.custom_op("ditattn::fp8_quantize_rows", mutates_args=())
def _quantize_rows_op(x: Tensor, gelu: bool, eps: float, use_triton: bool) -> tuple[Tensor, Tensor]:
    if use_triton:
        return _quantize_rows_triton(x, gelu, eps)
    return quantize_rows_reference(x, gelu=gelu, eps=eps)


@_quantize_rows_op.register_fake
def _(x, gelu, eps, use_triton):
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def _use_triton(x: Tensor, impl: str) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise AttentionConfigError(f"fp8 activation quantizer impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":  # the interpreter is for tests: "auto" on CPU tensors is the reference
        return _HAVE_TRITON and x.is_cuda
    if not _HAVE_TRITON:
        raise AttentionConfigError("fp8 activation quantizer impl='triton' needs Triton")
    return True


def quantize_rows(x: Tensor, *, gelu: bool = False, eps: float = EPS, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Per-row FP8 e4m3 quantization of ``x [..., K]`` (bfloat16) in one pass.

    Returns ``(q, scale)``: ``q [M, K]`` float8_e4m3fn (``M`` = the product of the leading
    dimensions) and ``scale [M, 1]`` float32 with ``x ~ q * scale`` row by row: ``scale =
    bf16(max(absmax, eps) / 448)``, ``q = e4m3(clamp(x / scale, -448, 448))`` (torchao's per-row
    numerics; module docstring).  ``gelu``: quantize ``gelu_tanh(x)`` instead (the tanh-GELU
    rounded to bfloat16 first).  ``impl``: ``"auto"`` (Triton on CUDA, the PyTorch reference
    elsewhere), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Guarantees for finite inputs: without ``gelu``, the Triton kernel and the reference are equal
    bit for bit (codes and scales), and equal torchao's ``Float8Tensor.from_hp(x, PerRow())`` on
    every row whose absmax is at least ``eps``.  With ``gelu``, the kernel's codes and scales are
    bit for bit those of the reference applied to the kernel's GELU values (:func:`gelu_bf16`),
    which are within one bf16 step (or 2^-124) of the correctly rounded tanh-GELU; so on every row
    whose GELU absmax is at least 2^-100, its scales are within one bf16 step and its codes within
    one e4m3 step of the float64 formula (tanh-GELU in float64, rounded to bf16, then quantized),
    almost all equal.  Against the reference (PyTorch's ``F.gelu``, then quantize), whose float32
    ``1 + tanh u`` cancels on the negative tail (absolute error up to 3.3e-7), the same holds on
    rows whose absmax is at least 1; on rows of smaller values ``F.gelu``'s own error can add steps.
    Non-finite inputs give unspecified codes.
    """
    if x.dtype != torch.bfloat16:
        raise AttentionConfigError(
            f"fp8 activation quantizer: expects bfloat16 activations, got {x.dtype} "
            "(--dit-quantization fp8 runs with --dtype bfloat16)"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise AttentionConfigError(f"fp8 activation quantizer: empty rows (shape {tuple(x.shape)})")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _quantize_rows_op(x2, bool(gelu), float(eps), _use_triton(x2, impl))


# ------------------------------------------------------------------------------------------------
# the linears


@functools.lru_cache(maxsize=None)
def _torchao_float8():
    """``(Float8Tensor, QuantizeTensorToFloat8Kwargs, PerRow)`` of torchao, or None without it."""
    try:
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows import Float8Tensor, QuantizeTensorToFloat8Kwargs
    except ImportError:
        return None
    return Float8Tensor, QuantizeTensorToFloat8Kwargs, PerRow


def why_not_fused(linear: nn.Module) -> Optional[str]:
    """Why the fused activation path cannot run ``linear`` (then its module runs torchao's own
    path), or None when it can: a plain ``nn.Linear`` whose weight is torchao's per-row e4m3
    ``Float8Tensor`` with per-row e4m3 dynamic activations, no activation bounds, no padding."""
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} (e.g. an unfused LoRA adapter) runs its own forward"
    w = linear.weight
    ao = _torchao_float8() if type(w).__module__.startswith("torchao") else None
    if ao is None or not isinstance(w, ao[0]):
        return "weight is not a torchao Float8Tensor"
    Float8Tensor, ActKwargs, PerRow = ao
    n, k = linear.out_features, linear.in_features
    if w.qdata.dtype != E4M3 or tuple(w.qdata.shape) != (n, k) or tuple(w.scale.shape) != (n, 1):
        return "weight is not per-row float8_e4m3fn"
    act = w.act_quant_kwargs
    if not (
        isinstance(act, ActKwargs)
        and act.float8_dtype == E4M3
        and isinstance(act.granularity, PerRow)
        and act.granularity.dim in (-1, 1)
        and act.hp_value_lb is None
        and act.hp_value_ub is None
    ):
        return "activations are not per-row float8_e4m3fn without bounds"
    if w.mm_config is None or w.mm_config.pad_inner_dim or w.mm_config.emulate:
        return "torchao GEMM config (padding / emulation) not supported"
    return None


def mark_fused(linear: nn.Module) -> Optional[str]:
    """Mark ``linear`` for the fused activation path when :func:`why_not_fused` allows it; returns
    the reason it stays on torchao's path otherwise."""
    reason = why_not_fused(linear)
    if reason is None:
        setattr(linear, FUSED_ATTR, True)
    return reason


def takes_fused(linear: nn.Module, fused: str = "auto") -> bool:
    """Whether ``linear`` runs the fused path now (marked, and fused ops not switched off)."""
    return fused != "torch" and getattr(linear, FUSED_ATTR, False)


def scaled_linear(q: Tensor, scale: Tensor, linear: nn.Linear, lead: Sequence[int]) -> Tensor:
    """``torch._scaled_mm`` of a quantized activation ``(q [M, K], scale [M, 1])`` with ``linear``'s
    torchao per-row weight, plus its bias, in bfloat16 -> ``[*lead, out_features]``."""
    w = linear.weight
    y = torch._scaled_mm(
        q,
        w.qdata.t(),
        scale_a=scale,
        scale_b=w.scale.t(),
        bias=linear.bias,
        out_dtype=torch.bfloat16,
        use_fast_accum=w.mm_config.use_fast_accum,
    )
    return y.view(*lead, linear.out_features)


def fp8_linears(
    x: Tensor, layers: Sequence[nn.Module], fused: str = "auto", *, gelu: bool = False
) -> tuple[Tensor, ...]:
    """``layer(x)`` for each of ``layers`` (``layer(gelu_tanh(x))`` with ``gelu``), quantizing ``x``
    once for every marked linear (self-attention q/k/v share it); unmarked layers run their module."""
    use = [takes_fused(m, fused) for m in layers]
    if not any(use):
        xs = F.gelu(x, approximate="tanh") if gelu else x
        return tuple(m(xs) for m in layers)
    q, scale = quantize_rows(x, gelu=gelu, impl=fused)
    xs = F.gelu(x, approximate="tanh") if gelu and not all(use) else x
    return tuple(scaled_linear(q, scale, m, x.shape[:-1]) if u else m(xs) for m, u in zip(layers, use))


def fp8_linear(x: Tensor, layer: nn.Module, fused: str = "auto", *, gelu: bool = False) -> Tensor:
    """:func:`fp8_linears` of one layer."""
    return fp8_linears(x, (layer,), fused, gelu=gelu)[0]
