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
5.3e-36 (where torchao's scale would be subnormal) is quantized against that floor.  The GELU (``gelu=True``) is rounded to the
activation dtype before its absmax, as ``F.gelu`` then quantize would; the Triton kernel computes it
as ``x * sigmoid(2u)`` (``u = sqrt(2/pi) (x + 0.044715 x^3)``), equal to PyTorch's ``0.5 x (1 +
tanh u)`` up to float32 rounding (an occasional 1-ulp bfloat16 difference before quantization).
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
EPS = 448.0 * 2.0 ** -126
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


#: rows up to this width are held in registers (one read); wider rows (the feed-forward's 8960 /
#: 13824) loop over LOOP_BLOCK-wide chunks twice, absmax then quantize (the second read hits L2)
ONE_PASS_MAX = 4096
LOOP_BLOCK = 2048

if _HAVE_TRITON:

    @triton.jit
    def _load_act(X, offs, K, GELU: tl.constexpr):
        x = tl.load(X + offs, mask=offs < K, other=0.0)
        if GELU:  # tanh-GELU = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), rounded like F.gelu's output
            xf = x.to(tl.float32)
            u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
            x = (xf / (1.0 + tl.exp(-2.0 * u))).to(X.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _store_q(Q, offs, K, xf, scale):
        q = tl.minimum(tl.maximum(tl.div_rn(xf, scale), -448.0), 448.0)
        tl.store(Q + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=offs < K)

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, K, stride_x, eps, GELU: tl.constexpr, BLOCK: tl.constexpr,
                              ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        X += row * stride_x
        Q += row * K
        offs = tl.arange(0, BLOCK)
        if ONE_PASS:
            xf = _load_act(X, offs, K, GELU)
            amax = tl.max(tl.abs(xf), axis=0)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                acc = tl.maximum(acc, tl.abs(_load_act(X, k0 + offs, K, GELU)))
            amax = tl.max(acc, axis=0)
        # the scale in the activation dtype (torchao: bf16 absmax / 448), then float32
        scale = tl.div_rn(tl.maximum(amax, eps), 448.0).to(X.dtype.element_ty).to(tl.float32)
        if ONE_PASS:
            _store_q(Q, offs, K, xf, scale)
        else:
            for k0 in range(0, K, BLOCK):
                _store_q(Q, k0 + offs, K, _load_act(X, k0 + offs, K, GELU), scale)
        tl.store(S + row, scale)


def _quantize_rows_triton(x: Tensor, gelu: bool, eps: float) -> tuple[Tensor, Tensor]:
    from ditattn.attention.kernels import check_device

    check_device(x, what="fp8 activation quantizer")
    M, K = x.shape
    q = torch.empty(M, K, dtype=E4M3, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        one_pass = K <= ONE_PASS_MAX
        block = triton.next_power_of_2(K) if one_pass else LOOP_BLOCK
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), eps, GELU=gelu, BLOCK=block, ONE_PASS=one_pass,
                                    num_warps=4 if block <= 2048 else 8)
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
    """
    if x.dtype != torch.bfloat16:
        raise AttentionConfigError(f"fp8 activation quantizer: expects bfloat16 activations, got {x.dtype} "
                                   "(--dit-quantization fp8 runs with --dtype bfloat16)")
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
    if not (isinstance(act, ActKwargs) and act.float8_dtype == E4M3 and isinstance(act.granularity, PerRow)
            and act.granularity.dim in (-1, 1) and act.hp_value_lb is None and act.hp_value_ub is None):
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
    y = torch._scaled_mm(q, w.qdata.t(), scale_a=scale, scale_b=w.scale.t(), bias=linear.bias,
                         out_dtype=torch.bfloat16, use_fast_accum=w.mm_config.use_fast_accum)
    return y.view(*lead, linear.out_features)


def fp8_linears(x: Tensor, layers: Sequence[nn.Module], fused: str = "auto", *, gelu: bool = False) -> tuple[Tensor, ...]:
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
