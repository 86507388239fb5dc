"""Correct bfloat16 / fp8 arithmetic for the kernels' CPU path in Triton's interpreter.

Triton's CPU interpreter (``TRITON_INTERPRET=1``, the path on which our kernels run without a GPU)
keeps bfloat16 and fp8 values as raw integer bits, and three operations the kernels rely on get
them wrong in triton 3.7: ``tl.dot`` on bfloat16 operands multiplies the bit patterns (upstream
reports it as not supported yet: triton-lang/triton#11584), float32 -> bfloat16 truncates instead
of rounding to nearest even (the GPU rounds), and float32 -> fp8 downcasts flush subnormal results
wrongly.  :func:`enable` routes these three through PyTorch's own conversions; every other
interpreter operation is untouched.  :func:`~ditattn.attention.kernels.check_device` calls it the
first time a kernel is launched on CPU tensors, so nothing changes on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

_TORCH_FP = {
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e5": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_ENABLED = False


def enable() -> bool:
    """Patch the interpreter's ``create_dot`` / ``create_fp_trunc`` / ``create_fp_to_fp`` (idempotent).
    Returns False, changing nothing, when this Triton's interpreter lacks the expected hooks."""
    global _ENABLED
    if _ENABLED:
        return True
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = getattr(interp, "InterpreterBuilder", None)
    if builder is None or not all(hasattr(builder, n) for n in ("create_dot", "create_fp_trunc", "create_fp_to_fp")):
        return False
    orig_trunc, orig_fp = builder.create_fp_trunc, builder.create_fp_to_fp

    def widen(data, dtype):
        if dtype == tl.bfloat16:
            return (data.astype(np.uint32) << 16).view(np.float32)
        if dtype.is_fp8():
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
            return t.view(_TORCH_FP[dtype.name]).float().numpy()
        return data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        ad, bd = widen(a.data, a.dtype.scalar), widen(b.data, b.dtype.scalar)
        return interp.TensorHandle(np.matmul(ad, bd, dtype=d.data.dtype) + d.data, d.dtype.scalar)

    def create_fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # round to nearest even
            y = torch.from_numpy(np.ascontiguousarray(src.data).copy()).to(torch.bfloat16).view(torch.int16)
            return interp.TensorHandle(y.numpy().view(np.uint16), tl.bfloat16)
        return orig_trunc(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if s.name in _TORCH_FP and d.name in _TORCH_FP and (s.is_fp8() or d.is_fp8()):
            x = torch.from_numpy(np.ascontiguousarray(src.data).copy())
            if s.is_fp8():
                x = x.view(torch.uint8).view(_TORCH_FP[s.name])
            elif s.name == "bf16":
                x = x.view(torch.int16).view(torch.bfloat16)
            y = x.to(_TORCH_FP[d.name])
            y = y.view(torch.uint8) if d.is_fp8() else (y.view(torch.int16) if d.name == "bf16" else y)
            return interp.TensorHandle(y.numpy().view(interp._get_np_dtype(dst_type)), d)
        return orig_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.create_fp_trunc = create_fp_trunc
    builder.create_fp_to_fp = create_fp_to_fp
    _ENABLED = True
    return True
