"""Quantized dense backends: ``sage_attn`` and ``sage_attn_3``.

``sage_attn`` (INT8 Q.K with smoothed K, FP16/BF16 or FP8 P.V; lossy) has several
implementations, chosen by its config key ``impl`` (schema: :data:`SAGE_ATTN_SCHEMA` below;
``ditattn backends`` lists it):

* ``sm90``: our warp-specialised Gluon kernel for Hopper
  (:func:`ditattn.attention.kernels.sage_sm90.sage_attention_sm90`: TMA producer warp, two consumer
  warpgroups, asynchronous INT8 Q.K and BF16/FP16 P.V ``wgmma``; per-token Q and K scales by default);
  SM90 only, head dims 64/128, non-causal, ``pv_dtype`` fp16 or fp8 (SageAttention2's FP8 P.V;
  ``impl=auto`` keeps fp8 on the Triton kernel until the H200 has measured the sm90 one);
* ``triton``: our Triton kernel (:func:`ditattn.attention.kernels.int8_attention.int8_attention`:
  per-token Q / per-block K INT8 scales, online softmax, LSE, GQA); CUDA fp16/bf16 (or CPU under
  ``TRITON_INTERPRET=1``), head dims ``SUPPORTED_HEAD_DIMS``;
* ``package``: the ``sageattention`` package (CUDA and MUSA; no LSE; its own P.V precision, so
  ``pv_dtype`` fp16 only; on Hopper only a build with the upstream SM90 binding fix, not PyPI's
  2.2.0).  sageattention 1.0.6 subtracts the key mean from its K argument in place, so it gets a
  clone;
* ``reference``: :func:`ditattn.attention.kernels.int8_reference.int8_attention_reference`, the same
  quantization in PyTorch (float32, float16 or bfloat16; any device);
* ``auto`` (default): :func:`auto_impl`.  On CUDA that is :func:`sage_cuda_runtime`, the rule
  the capability row and the plan's runtime label (:func:`_runtime_label`) apply too, so the
  plan names what runs: on SM90 the sm90 kernel (head dims 64/128, fp16 P.V; a causal call falls
  back to the Triton kernel), else the Triton kernel on SM90 (measured faster than sageattention
  1.0.6 there, see docs/benchmarks.md), whenever the LSE or ``pv_dtype`` fp8 is needed and when the
  package is missing, else the package.  On Hopper a call the in-tree kernel cannot serve (head dims other
  than 32/64/128) needs the package with the SM90 fix; without it the selector has already put
  ``fa`` on such layers (upstream (SGLang)'s fallback, recorded in the plan).  MUSA: the package.  Other
  devices: the reference.

``pv_dtype`` is the P.V precision (``fp16``, the default: about 1 % relative error on random
inputs; ``fp8``: faster tensor-core rate, about 3.7 %), ``pv_accum`` how FP8 P.V accumulates
(``two_level`` or ``direct``); ``qk_dtype`` only ``int8`` so far;
``k_granularity`` the K scale granularity (``token`` or ``block``; ``auto``: token on sm90 and the
reference, block on the Triton kernel); ``qk_balance`` (alpha in (0, 1], unset: off) the per-channel
Q/K balance before the INT8 rounding, the same quantization in the sm90 and Triton kernels' prologue
and in the reference (the package has none: with it ``auto`` picks the Triton kernel where it would pick the
package, and the plan says so).  A new
implementation is one more :class:`SageImpl` row in :data:`SAGE_IMPLS` (its name in the schema's
``impl`` choices, and a place in :func:`auto_impl` / ``sage_cuda_runtime`` if ``auto`` should pick
it).

``sage_attn_3`` (SageAttention3, FP4 microscaling, Blackwell only) is :mod:`ditattn.attention.backends.sage3`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Callable, Optional

import torch

from ditattn.attention.backends.base import AttnCall, register
from ditattn.attention.backends.sage_crossover import crossover_label, dense_below_crossover
from ditattn.attention.config import complete_backend_config
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import SAGE_IMPLS as SAGE_IMPL_CHOICES
from ditattn.attention.schemas import (
    SAGE_K_GRANULARITIES,
    SAGE_PV_ACCUMS,
    SAGE_PV_DTYPES,
    SAGE_QK_DTYPES,
    SAGE_QK_IMPLEMENTED,
    P,
    in_range,
    non_negative,
)
from ditattn.attention.specs import ALL_FLOAT, BackendSpec, Runtime
from ditattn.errors import AttentionConfigError, BackendUnavailableError
from ditattn.platforms import Platform, current_platform, platform_for_device
from ditattn.settings import check_retired

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _load(module: str, attr: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:
        log.debug("%s.%s not usable: %s", module, attr, exc)
        return None


# ------------------------------------------------------------------------------------------------
# which implementation: the one rule (capability row, plan label and impl=auto all read it)

# Head dims of ditattn's in-tree INT8 sage kernel (kernels/int8_attention.py SUPPORTED_HEAD_DIMS).
SAGE_INTREE_HEAD_DIMS = (32, 64, 128)
SAGE_SM90_HEAD_DIMS = (64, 128)  # the warp-specialised Gluon kernel (impl sm90)
SAGE_SM90_FIX_COMMIT = "d9704247a5139ab4c03bf7fc6b35cc0e2cbb5ea4"
SAGE_SM90_FIX_INSTALL = (
    f"pip install --force-reinstall git+https://github.com/thu-ml/SageAttention.git@"
    f"{SAGE_SM90_FIX_COMMIT} --no-build-isolation"
)


def sage_lacks_sm90_fix(platform: Platform) -> bool:
    """True when the installed ``sageattention`` is a 2.x build up to 2.2.0 from a package index:
    those lack the upstream SM90 binding fix (upstream notes: PyPI ``sageattention==2.2.0`` does not
    work on Hopper). 1.x is Triton-only (no binding); a git install (``+git.<sha>``) or a later
    release is taken as fixed; an unknown version counts as fixed."""
    ver = platform.package_version("sageattention")
    if not ver or "+git" in ver:
        return False
    parts = []
    for x in ver.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in x if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    parts += [0] * (3 - len(parts))
    return parts[0] == 2 and tuple(parts) <= (2, 2, 0)


def sage_cuda_runtime(
    platform: Platform, head_dim: int | None, needs_lse: bool = False, pv_dtype: str = "fp16", qk_balance: bool = False
) -> tuple[str | None, str]:
    """Which CUDA implementation serves ``sage_attn`` for ``head_dim`` under ``impl=auto`` (the
    automatic rule, shared by the selector and the backend so the plan names what runs):
    ``("sm90", "")`` (the warp-specialised Gluon kernel: SM90, head dim 64/128, fp16 P.V),
    ``("triton", "")`` (the in-tree INT8 kernel: on SM90, where it measured faster, when the LSE or
    ``pv_dtype`` fp8 or ``qk_balance`` is needed, and without the package), ``("package", "")``
    (sageattention) or ``(None, reason)``.  The names are keys of ``backends.sage.SAGE_IMPLS``."""
    has_pkg = platform.has_package("sageattention")
    if (
        platform.sm == 90
        and platform.has_package("triton")
        and pv_dtype == "fp16"
        and (head_dim is None or head_dim in SAGE_SM90_HEAD_DIMS)
    ):
        return "sm90", ""  # measured fastest on the H200 (docs/benchmarks.md section 2)
    intree = platform.has_package("triton") and (head_dim is None or head_dim in SAGE_INTREE_HEAD_DIMS)
    pkg_broken = has_pkg and platform.sm == 90 and sage_lacks_sm90_fix(platform)
    # the package returns no LSE, picks its own P.V precision and quantizes Q / K its own way
    pkg_fits = not needs_lse and pv_dtype == "fp16" and not qk_balance
    if intree and (not pkg_fits or not has_pkg or platform.sm == 90):
        return "triton", ""
    if has_pkg and pkg_fits and not pkg_broken:
        return "package", ""
    why_intree = (
        "the in-tree INT8 kernel needs Triton"
        if not platform.has_package("triton")
        else f"the in-tree INT8 kernel supports head dims {'/'.join(map(str, SAGE_INTREE_HEAD_DIMS))}, not {head_dim}"
    )
    if not has_pkg:
        return None, f"{why_intree}, and package 'sageattention' is not installed; install: pip install sageattention"
    if pkg_broken:
        ver = platform.package_version("sageattention")
        return None, (
            f"{why_intree}, and sageattention {ver} lacks the upstream SM90 binding fix on Hopper "
            f"(install: {SAGE_SM90_FIX_INSTALL})"
        )
    if needs_lse:
        return None, f"{why_intree}, and the sageattention package returns no LSE (ring attention needs it)"
    if qk_balance:
        return None, f"{why_intree}, and the sageattention package has no qk_balance"
    return None, f"{why_intree}, and the sageattention package has no pv_dtype {pv_dtype} (fp16 only)"


def _runtime_broken(rt: Runtime, platform: Platform) -> Optional[str]:
    """Why an installed ``sage_attn`` runtime does not work on ``platform`` (None: it does, or it is not
    installed): the ``sageattention`` package of a 2.x release up to 2.2.0 on Hopper (no SM90 binding fix)."""
    if (
        "sageattention" in rt.modules
        and platform.name == "cuda"
        and platform.sm == 90
        and platform.has_package("sageattention")
        and sage_lacks_sm90_fix(platform)
    ):
        return (
            f"sageattention {platform.package_version('sageattention')} lacks the upstream SM90 binding fix "
            f"on Hopper (install: {SAGE_SM90_FIX_INSTALL})"
        )
    return None


def _sage_check(spec, req, platform):
    if platform.name == "musa" and req.needs_lse:
        return ["on MUSA sage_attn runs the sageattention package, which returns no LSE (ring attention needs it)"]
    if platform.name != "cuda" or spec.runtime_on(platform) is None:
        return []  # off CUDA, or no runtime at all: platform_reasons already says why
    impl, why = sage_cuda_runtime(platform, req.head_dim, req.needs_lse)
    return [] if impl else [why]


def _runtime_label(spec, platform: Platform, req, config) -> str:
    """The plan's runtime label of ``sage_attn`` for ``req`` under ``config``: the implementation
    ``impl`` names, or under ``auto`` the one :func:`sage_cuda_runtime` picks (CUDA; on SM90 with the
    Hopper crossover's dense range, :mod:`ditattn.attention.backends.sage_crossover`); elsewhere the
    first installed runtime of the platform."""
    if platform.name != "cuda" or req is None:
        rt = spec.runtime_on(platform)
        return rt.label if rt is not None else ""
    cfg = config or {}
    impl = cfg.get("impl", "auto")
    if impl == "auto":
        impl = sage_cuda_runtime(
            platform, req.head_dim, req.needs_lse, cfg.get("pv_dtype", "fp16"), bool(cfg.get("qk_balance"))
        )[0]
    module = {"triton": "triton", "package": "sageattention", "sm90": "triton.experimental.gluon"}.get(impl)
    labels = {rt.modules[0]: rt.label for rt in spec.runtimes["cuda"]}
    label = labels.get(module) or (spec.runtimes["cpu"][0].label if impl == "reference" else "")
    return label + crossover_label(platform, cfg) if label else label


def _qk_implemented(v):
    return None if v in SAGE_QK_IMPLEMENTED else f"no sage_attn kernel implements {v} Q.K yet"


SAGE_ATTN_SCHEMA = (
    P(
        "impl",
        "str",
        "auto",
        "Implementation: auto (CUDA: the rule the plan reports — SM90: the warp-specialised Gluon kernel (sm90) for "
        "head dim 64/128 with fp16 P.V, else the in-tree Triton INT8 kernel; other GPUs: the sageattention package "
        "when it is installed and neither the LSE nor pv_dtype fp8 is needed, else the Triton kernel; MUSA: the "
        "package; CPU: reference), triton (in-tree INT8 kernel; CUDA, or CPU under TRITON_INTERPRET=1), package "
        "(sageattention; CUDA/MUSA, no LSE, fp16 P.V; on Hopper only a build with the SM90 fix), reference (PyTorch, "
        "any device), sm90 (Gluon kernel: SM90 only, head dim 64/128, fp16 or fp8 P.V, non-causal)",
        choices=SAGE_IMPL_CHOICES,
    ),
    P(
        "pv_dtype",
        "str",
        "fp16",
        "P.V precision: fp16 (about 1.3 % relative error on random inputs) or fp8 (P and V in e4m3: twice the "
        "tensor-core rate, about 3.7 % on random and structured inputs); impl package chooses its own and accepts "
        "fp16 only; impl auto runs fp8 on the Triton kernel (sm90 serves it with impl sm90)",
        choices=SAGE_PV_DTYPES,
    ),
    P(
        "pv_accum",
        "str",
        "two_level",
        "FP8 P.V accumulation (pv_dtype fp8 only): two_level (each key block's P.V in a fresh accumulator, added in "
        "FP32) or direct (one accumulator across all keys: fewer instructions, but the FP8 tensor cores add with "
        "fewer mantissa bits than FP32, so the error grows with the sequence length; impl sm90 or triton)",
        choices=SAGE_PV_ACCUMS,
    ),
    P(
        "qk_dtype",
        "str",
        "int8",
        "Q.K precision: int8 (per-token Q scales, smoothed K); fp8 is reserved for a kernel that implements it",
        choices=SAGE_QK_DTYPES,
        check=_qk_implemented,
        accepted="int8 (fp8: no kernel yet)",
    ),
    P(
        "k_granularity",
        "str",
        "auto",
        "INT8 scale granularity of the smoothed K: token (one scale per key; 1.7 % error on structured inputs) or "
        "block (one per 128 keys; 2.3 %, about 10 % faster on the sm90 kernel); auto: token on sm90 and reference, "
        "block on the Triton kernel (the only one it has)",
        choices=SAGE_K_GRANULARITIES,
    ),
    P(
        "min_seq_len",
        "int",
        16384,
        "Hopper crossover: with impl auto on an SM90 GPU a call shorter than this many query tokens runs fa (exact "
        "dense) instead, where it is faster (H200, vs FlashAttention-4: 0.70x at 4096 tokens head dim 64, 0.89x at "
        "4096/128, 0.97-0.98x at 4.6k-8k, 1.02x at 16k x 40 heads, 1.09-1.13x at 32k); 0 keeps sage_attn at every "
        "length",
        check=non_negative,
        accepted="an integer >= 0 (0: off)",
    ),
    P(
        "qk_balance",
        "float",
        None,
        "Per-channel Q/K balance before the INT8 rounding (SmoothQuant-style, per batch and K/V head: Q's channels "
        "times c, smoothed K's divided by c, c = amax|K~|^a / amax|Q|^(1-a) normalised to geometric mean 1, so Q.K "
        "is unchanged): unset = off; a in (0, 1]. CPU reference (docs/sage_kernel.md): token K scales with a = 0.5 "
        "bring the worst structured input from 2.09 % to 1.82 % error (every structured input <= 1.83 %), real DiT "
        "activations unchanged (<= 0.47 %); block K scales with a = 0.75 take 0.04-0.5 pp off but stay above 2 % on "
        "some inputs. Costs one more read of Q in the quantization prologue (impl sm90, triton, reference; not the "
        "package)",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1] (unset: off)",
    ),
)


# ------------------------------------------------------------------------------------------------
# sage_attn implementations: why_not(q, call, cfg) -> reason or None; run(q, k, v, call, cfg) -> (out, lse)


def _triton_why_not(q: torch.Tensor, call: AttnCall, cfg: dict) -> Optional[str]:
    import importlib.util

    from ditattn.attention.kernels import interpreting

    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        return f"the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), not {q.device.type}"
    if importlib.util.find_spec("triton") is None:
        return "the Triton kernel needs the triton package (pip install triton, or ditattn[gpu])"
    from ditattn.attention.kernels.int8_attention import SUPPORTED_HEAD_DIMS

    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the Triton kernel takes float16/bfloat16, not {str(q.dtype).replace('torch.', '')}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"the Triton kernel supports head dim {list(SUPPORTED_HEAD_DIMS)}, not {q.shape[-1]}"
    if cfg.get("k_granularity") == "token":
        return "the Triton kernel scales K per block of keys (k_granularity token: impl sm90 or reference)"
    return None


def _triton_run(q, k, v, call: AttnCall, cfg: dict):
    from ditattn.attention.kernels.int8_attention import int8_attention

    fp8_direct = cfg["pv_dtype"] == "fp8" and cfg.get("pv_accum") == "direct"
    return int8_attention(
        q,
        k,
        v,
        scale=call.scale,
        causal=call.causal,
        return_lse=call.return_lse,
        pv=cfg["pv_dtype"],
        config={"fp8_acc": 0} if fp8_direct else None,
        qk_balance=cfg.get("qk_balance"),
    )


def _package_install_problem(q: torch.Tensor) -> Optional[str]:
    """Why the installed sageattention cannot run at all here: missing, or (Hopper) a build without
    the upstream SM90 binding fix.  None: it can."""
    if _load("sageattention", "sageattn") is None:
        return "package 'sageattention' is not installed (pip install sageattention)"
    platform = platform_for_device(q.device)
    if platform.name == "cuda" and platform.sm == 90 and sage_lacks_sm90_fix(platform):
        return (
            f"sageattention {platform.package_version('sageattention')} lacks the upstream SM90 binding fix "
            f"on Hopper; install: {SAGE_SM90_FIX_INSTALL}"
        )
    return None


def _sm90_why_not(q: torch.Tensor, call: AttnCall, cfg: dict) -> Optional[str]:
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        where = q.device.type if q.device.type != "cuda" else "SM%d%d" % torch.cuda.get_device_capability(q.device)
        return f"the sm90 kernel needs an SM90 (Hopper) GPU, not {where}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the sm90 kernel takes float16/bfloat16, not {str(q.dtype).replace('torch.', '')}"
    if q.shape[-1] not in SAGE_SM90_HEAD_DIMS:
        return f"the sm90 kernel supports head dim {list(SAGE_SM90_HEAD_DIMS)}, not {q.shape[-1]}"
    if call.causal:
        return "the sm90 kernel is non-causal only (the Triton kernel serves causal calls)"
    if _load("triton.experimental.gluon", "jit") is None:
        return "the sm90 kernel needs Triton with the Gluon dialect (triton >= 3.5)"
    return None


def _k_granularity(cfg: dict, auto: str) -> str:
    return auto if cfg.get("k_granularity", "auto") == "auto" else cfg["k_granularity"]


def _sm90_run(q, k, v, call: AttnCall, cfg: dict):
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    config = {
        "k_granularity": _k_granularity(cfg, "token"),
        "pv_dtype": cfg["pv_dtype"],
        "qk_balance": cfg.get("qk_balance"),
    }
    if cfg["pv_dtype"] == "fp8":
        config["pv_accum"] = cfg["pv_accum"]
    return sage_attention_sm90(q, k, v, scale=call.scale, return_lse=call.return_lse, config=config)


def _package_why_not(q: torch.Tensor, call: AttnCall, cfg: dict) -> Optional[str]:
    problem = _package_install_problem(q)
    if problem is not None:
        return problem
    if q.device.type not in ("cuda", "musa"):
        return f"the sageattention package runs on CUDA and MUSA, not {q.device.type}"
    if call.return_lse:
        return "the sageattention package returns no LSE (needed here)"
    if cfg["pv_dtype"] != "fp16":
        return (
            f"the sageattention package chooses its own P.V precision (pv_dtype {cfg['pv_dtype']} needs impl "
            "triton or reference)"
        )
    if cfg.get("qk_balance"):
        return (
            "the sageattention package quantizes Q and K its own way (qk_balance needs impl sm90, triton or reference)"
        )
    return None


def _package_run(q, k, v, call: AttnCall, cfg: dict):
    sageattn = _load("sageattention", "sageattn")
    # sageattention 1.0.6 does `k -= k.mean(...)` on its argument: never hand it ours
    return sageattn(q, k.clone(), v, tensor_layout="NHD", is_causal=call.causal, sm_scale=call.scale), None


def _reference_why_not(q: torch.Tensor, call: AttnCall, cfg: dict) -> Optional[str]:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the reference takes float32/float16/bfloat16, not {str(q.dtype).replace('torch.', '')}"
    if cfg.get("pv_dtype") == "fp8" and cfg.get("pv_accum") == "direct":
        return (
            "the reference adds each key block's FP8 P.V in float32 (pv_accum two_level); direct "
            "accumulation is a property of the FP8 tensor cores (impl sm90 or triton)"
        )
    return None


def _reference_run(q, k, v, call: AttnCall, cfg: dict):
    from ditattn.attention.kernels.int8_reference import int8_attention_reference

    return int8_attention_reference(
        q,
        k,
        v,
        scale=call.scale,
        causal=call.causal,
        return_lse=call.return_lse,
        pv=cfg["pv_dtype"],
        k_granularity=_k_granularity(cfg, "token"),
        qk_balance=cfg.get("qk_balance"),
    )


@dataclasses.dataclass(frozen=True)
class SageImpl:
    """One implementation of ``sage_attn``: ``why_not(q, call, cfg)`` says why it cannot serve a
    call (None: it can); ``run(q, k, v, call, cfg)`` returns ``(out, lse | None)``; ``qk_dtypes`` /
    ``pv_dtypes``: the precisions it implements."""

    why_not: Callable[[torch.Tensor, AttnCall, dict], Optional[str]]
    run: Callable
    qk_dtypes: tuple = ("int8",)
    pv_dtypes: tuple = SAGE_PV_DTYPES


SAGE_IMPLS: dict[str, SageImpl] = {
    "sm90": SageImpl(_sm90_why_not, _sm90_run),
    "triton": SageImpl(_triton_why_not, _triton_run),
    "package": SageImpl(_package_why_not, _package_run, pv_dtypes=("fp16",)),
    "reference": SageImpl(_reference_why_not, _reference_run),
}


def auto_impl(
    device_type: str,
    head_dim: int,
    need_lse: bool = False,
    pv_dtype: str = "fp16",
    platform: Optional[Platform] = None,
    qk_balance: bool = False,
) -> str:
    """The :data:`SAGE_IMPLS` key ``impl=auto`` runs for a call on ``device_type`` with ``head_dim``.

    CUDA: :func:`sage_cuda_runtime` on ``platform`` (default: the current
    one), the rule the selector labels the plan with; MUSA: the sageattention package (upstream's
    MUSA support); other devices: the PyTorch reference.  Raises :class:`BackendUnavailableError`
    with the reason when nothing may serve the call on CUDA."""
    if device_type == "cuda":
        name, why = sage_cuda_runtime(platform or current_platform(), head_dim, need_lse, pv_dtype, qk_balance)
        if name is None:
            raise BackendUnavailableError("sage_attn", [why])
        return name
    return "package" if device_type == "musa" else "reference"


def sage_impl_for(q: torch.Tensor, call: AttnCall, cfg: Optional[dict] = None) -> str:
    """The ``sage_attn`` implementation that serves this call under config ``cfg`` (defaults for
    missing keys).  An explicit ``impl`` that cannot serve the call, or ``auto`` with no
    implementation that can, raises :class:`AttentionConfigError` with the reasons
    (:class:`BackendUnavailableError` when ``impl=package`` and the package is missing or, on Hopper,
    lacks the SM90 fix; and when ``auto`` has nothing on CUDA, see :func:`auto_impl`)."""
    cfg = complete_backend_config(B.SAGE_ATTN, cfg)
    if cfg["pv_dtype"] != "fp8" and cfg["pv_accum"] != "two_level":
        raise AttentionConfigError(
            f"sage_attn: pv_accum {cfg['pv_accum']} applies to pv_dtype fp8 only (fp16 P.V "
            "accumulates in FP32); accepted with pv_dtype fp16: two_level (the default)"
        )
    if cfg["impl"] == "auto":
        name = auto_impl(
            q.device.type,
            q.shape[-1],
            call.return_lse,
            cfg["pv_dtype"],
            platform_for_device(q.device),
            bool(cfg.get("qk_balance")),
        )
    else:
        name = cfg["impl"]
    impl = SAGE_IMPLS[name]
    why = impl.why_not(q, call, cfg)
    if why is None and cfg["qk_dtype"] in impl.qk_dtypes and cfg["pv_dtype"] in impl.pv_dtypes:
        return name
    # e.g. a causal call on sm90: the Triton kernel serves it
    if cfg["impl"] == "auto" and name == "sm90":
        alt = SAGE_IMPLS["triton"].why_not(q, call, cfg)
        if alt is None:
            return "triton"
        why = f"{why}; triton: {alt}"
    if cfg["impl"] == "package" and why is not None and why == _package_install_problem(q):
        raise BackendUnavailableError("sage_attn", [f"impl package: {why}"])
    raise AttentionConfigError(
        f"sage_attn: no implementation can serve this call (impl {cfg['impl']}): "
        f"{name}: {why or 'does not implement these precisions'}"
    )


@register(
    B.SAGE_ATTN,
    schema=SAGE_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="quantized",
        summary="SageAttention: INT8 Q.K with smoothed K, FP16/FP8 P.V",
        runtimes={
            "cuda": (
                Runtime(("triton",), "in-tree Triton INT8 kernel"),
                Runtime(("sageattention",), "sageattention package"),
                Runtime(("triton.experimental.gluon",), "in-tree Gluon SM90 kernel"),
            ),
            "musa": (Runtime(("sageattention",), "sageattention package"),),
            "cpu": (Runtime((), "in-tree PyTorch reference"),),
        },
        upstream_platforms=("cuda", "musa"),
        cpu_dtypes=ALL_FLOAT,
        cuda_sm=(80, 86, 89, 90, 120),
        lossy=True,
        returns_lse=True,
        drop_in=True,
        max_head_dim=128,
        install_hint="pip install sageattention",
        config_schema="sage_attn",
        notes="lossy (INT8 Q.K); upstream SM list SM80/86/89/90/120; on Hopper a call the in-tree kernel "
        "cannot serve falls back to fa when the installed sageattention lacks the SM90 fix; "
        "on MUSA it runs the sageattention package (no LSE)",
        extra_check=_sage_check,
        runtime_label=_runtime_label,
        runtime_broken=_runtime_broken,
    ),
)
def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, config: dict):
    """``sage_attn``: q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]``; returns ``(out, lse|None)``.

    Lossy (INT8 Q.K).  No additive bias.  CUDA and MUSA: fp16/bf16; CPU: float32/float16/bfloat16.
    ``config``: ``impl``, ``pv_dtype``, ``qk_dtype`` (missing keys take their defaults).
    """
    if call.attn_bias is not None:
        raise AttentionConfigError("sage_attn: does not accept an additive attention bias/mask; accepted: no bias")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise AttentionConfigError(
            "sage_attn does not support autograd: its INT8 Q.K has no gradient, so the gradients through it would "
            "be wrong, not merely approximate; accepted: call it under torch.no_grad() or torch.inference_mode(), "
            "or use torch_sdpa for a differentiable call"
        )
    if q.device.type != "cpu" and q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(
            f"sage_attn: dtype {str(q.dtype).replace('torch.', '')} not supported on {q.device.type} "
            "(accepts float16, bfloat16)"
        )
    # the measured Hopper crossover (fa is faster there), checked before the config is completed: these
    # calls are host-bound, so the routed path adds as little Python as it can to fa's own
    routed = dense_below_crossover(q, k, v, call, config)
    if routed is not None:
        return routed
    check_retired("DITATTN_SAGE_IMPL", "DITATTN_SAGE_PV")  # (the variables chose sage's own kernel)
    cfg = complete_backend_config(B.SAGE_ATTN, config)
    return SAGE_IMPLS[sage_impl_for(q, call, cfg)].run(q, k, v, call, cfg)
