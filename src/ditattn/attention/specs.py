"""Capability facts of every backend, as data, and the check that explains a refusal.

``SPECS[backend].reasons(request, platform)`` returns a list of human-readable reasons why the
backend cannot serve ``request`` on ``platform`` (empty list = usable).  The selector, the CLI
``backends`` table, the per-request override validation and the tests all read these facts; no
other module hard-codes what a backend can do.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from ditattn.attention.names import CROSS_ROLES, AttentionBackendEnum as B
from ditattn.platforms import Platform

FP16_BF16 = frozenset({torch.float16, torch.bfloat16})
ALL_FLOAT = frozenset({torch.float32, torch.float16, torch.bfloat16})
BF16 = frozenset({torch.bfloat16})
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


@dataclasses.dataclass(frozen=True)
class LayerRequest:
    """What one attention layer (or one call) needs from a backend.

    role: ``"self"``, ``"cross"`` or ``"cross_image"`` (``names.ROLES``). head_dim, dtype: of q/k/v.
    needs_bias: the layer adds a bias
    or mask to the scores. needs_lse: the caller merges partial results (ring attention).
    varlen: packed variable-length sequences. seq_q/seq_kv/batch: known only for a concrete call.
    """

    role: str = "self"
    head_dim: int | None = None
    dtype: torch.dtype | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    causal: bool = False
    needs_bias: bool = False
    needs_lse: bool = False
    varlen: bool = False
    seq_q: int | None = None
    seq_kv: int | None = None
    batch: int | None = None


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How a backend runs on one platform: alternative import names (empty = in-tree/built in).

    missing: non-empty when the seed names this runtime but this build has no kernel path for it
    (the reason); such a runtime never counts as available, so the backend is refused or, where
    the seed allows it, substituted (``fa`` -> ``torch_sdpa``) with this reason.
    """

    modules: tuple[str, ...] = ()
    label: str = "in-tree"
    missing: str = ""


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    backend: B
    kind: str  # dense | quantized | sparse | sparse+quantized | sparse+linear
    summary: str
    runtimes: Mapping[str, tuple[Runtime, ...]]  # platform name -> alternatives (any one suffices)
    seed_platforms: tuple[str, ...]  # the source document's support matrix
    dtypes: frozenset = FP16_BF16
    cpu_dtypes: frozenset | None = None  # dtypes of the CPU reference path, when it differs
    head_dims: frozenset[int] | None = None
    max_head_dim: int | None = 256
    cuda_sm: tuple[int, ...] | None = None  # allowed SM numbers, e.g. (80, 86, 90)
    cuda_sm_min: int | None = None
    lossy: bool = False
    cross_attention: bool = True
    returns_lse: bool = False
    accepts_bias: bool = False
    causal: bool = True
    varlen: bool = False
    drop_in: bool = False
    install_hint: str = ""
    config_schema: str | None = None  # key into config.SCHEMAS
    notes: str = ""
    missing_kernel: str = ""  # non-empty: this build has no kernel for it (the reason)
    extra_check: Callable[["BackendSpec", LayerRequest, Platform], list[str]] | None = None

    @property
    def name(self) -> str:
        return self.backend.value

    @property
    def sparse(self) -> bool:
        return self.kind.startswith("sparse")

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self.runtimes)

    def runtime_on(self, platform: Platform) -> Runtime | None:
        """The first installed runtime on ``platform`` that works there, or None."""
        for rt in self.runtimes.get(platform.name, ()):
            if (not rt.missing and (not rt.modules or platform.has_any(rt.modules))
                    and runtime_broken(rt, platform) is None):
                return rt
        return None

    def runtime_reason(self, platform: Platform) -> str | None:
        """Why no runtime of this backend is available on ``platform`` (None: one is)."""
        if self.runtime_on(platform) is not None:
            return None
        rts = self.runtimes.get(platform.name, ())
        broken = [b for b in (runtime_broken(rt, platform) for rt in rts) if b]
        if broken:
            return "; ".join(broken)
        if rts and all(rt.missing for rt in rts):
            return "; ".join(rt.missing for rt in rts)
        mods = [m for rt in rts if not rt.missing for m in rt.modules]
        hint = f"; install: {self.install_hint}" if self.install_hint else ""
        return f"needs package {' or '.join(repr(m) for m in mods)} (not installed){hint}"

    def platform_reasons(self, platform: Platform) -> list[str]:
        """Why the backend cannot run on ``platform`` at all (platform, SM, missing package)."""
        if platform.name not in self.runtimes:
            where = ", ".join(self.runtimes) or "no platform in this build"
            return [f"not supported on {platform.name} (runs on: {where})"]
        reasons = []
        if self.missing_kernel:
            reasons.append(self.missing_kernel)
        if platform.name == "cuda" and platform.sm is not None:
            if self.cuda_sm is not None and platform.sm not in self.cuda_sm:
                reasons.append(
                    f"needs CUDA compute capability SM{'/'.join(map(str, self.cuda_sm))}, "
                    f"this GPU is SM{platform.sm}"
                )
            if self.cuda_sm_min is not None and platform.sm < self.cuda_sm_min:
                reasons.append(f"needs CUDA SM{self.cuda_sm_min}+, this GPU is SM{platform.sm}")
        missing = self.runtime_reason(platform)
        if missing is not None and not self.missing_kernel:
            reasons.append(missing)
        return reasons

    def reasons(self, req: LayerRequest, platform: Platform) -> list[str]:
        """Every reason this backend cannot serve ``req`` on ``platform`` (empty = usable)."""
        reasons = self.platform_reasons(platform)
        dtypes = self.cpu_dtypes if platform.name == "cpu" and self.cpu_dtypes else self.dtypes
        if req.dtype is not None and req.dtype not in dtypes:
            reasons.append(
                f"dtype {DTYPE_NAMES.get(req.dtype, req.dtype)} not supported "
                f"(accepts {', '.join(sorted(DTYPE_NAMES[d] for d in dtypes))})"
            )
        if req.head_dim is not None:
            if self.head_dims is not None and req.head_dim not in self.head_dims:
                reasons.append(
                    f"head dim {req.head_dim} not supported (accepts {sorted(self.head_dims)})"
                )
            elif self.max_head_dim is not None and req.head_dim > self.max_head_dim:
                reasons.append(f"head dim {req.head_dim} > {self.max_head_dim}")
        reasons.extend(self.semantic_reasons(req))
        if self.extra_check is not None:
            reasons.extend(self.extra_check(self, req, platform))
        return reasons

    def semantic_reasons(self, req: LayerRequest) -> list[str]:
        """Reasons about what the layer computes (cross-attention, bias, LSE, causal, varlen): a
        platform substitution never overrides these."""
        reasons = []
        if req.role in CROSS_ROLES and not self.cross_attention:
            reasons.append("cannot serve cross-attention (sparse video attention needs self-attention)")
        if req.needs_bias and not self.accepts_bias:
            reasons.append("does not accept an additive attention bias/mask, which this layer needs")
        if req.needs_lse and not self.returns_lse:
            reasons.append("does not return the softmax LSE that ring attention needs")
        if req.causal and not self.causal:
            reasons.append("does not support causal attention")
        if req.varlen and not self.varlen:
            reasons.append("does not support packed variable-length attention")
        return reasons


def _fa_check(spec, req, platform):
    if platform.name == "xpu" and req.head_dim is not None and req.head_dim not in (64, 96, 128, 192, 256):
        return [f"XPU flash attention supports head sizes 64/96/128/192/256, not {req.head_dim}"]
    return []


# Head dims of ditattn's in-tree INT8 sage kernel (kernels/int8_attention.py SUPPORTED_HEAD_DIMS).
SAGE_INTREE_HEAD_DIMS = (32, 64, 128)
SAGE_SM90_HEAD_DIMS = (64, 128)  # the warp-specialised Gluon kernel (impl sm90)
SAGE_SM90_FIX_COMMIT = "d9704247a5139ab4c03bf7fc6b35cc0e2cbb5ea4"
SAGE_SM90_FIX_INSTALL = (f"pip install --force-reinstall git+https://github.com/thu-ml/SageAttention.git@"
                         f"{SAGE_SM90_FIX_COMMIT} --no-build-isolation")


def runtime_broken(rt: Runtime, platform: Platform) -> str | None:
    """Why an installed runtime does not work on ``platform`` (None: it does, or it is not installed):
    the ``sageattention`` package of a 2.x release up to 2.2.0 on Hopper (no SM90 binding fix)."""
    if ("sageattention" in rt.modules and platform.name == "cuda" and platform.sm == 90
            and platform.has_package("sageattention") and sage_lacks_sm90_fix(platform)):
        return (f"sageattention {platform.package_version('sageattention')} lacks the upstream SM90 binding fix "
                f"on Hopper (install: {SAGE_SM90_FIX_INSTALL})")
    return None


def sage_lacks_sm90_fix(platform: Platform) -> bool:
    """True when the installed ``sageattention`` is a 2.x build up to 2.2.0 from a package index:
    those lack the upstream SM90 binding fix (the seed: PyPI ``sageattention==2.2.0`` does not
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


def sage_cuda_runtime(platform: Platform, head_dim: int | None, needs_lse: bool = False,
                      pv_dtype: str = "fp16", qk_balance: bool = False) -> tuple[str | None, str]:
    """Which CUDA implementation serves ``sage_attn`` for ``head_dim`` under ``impl=auto`` (the
    automatic rule, shared by the selector and the backend so the plan names what runs):
    ``("sm90", "")`` (the warp-specialised Gluon kernel: SM90, head dim 64/128, fp16 P.V),
    ``("triton", "")`` (the in-tree INT8 kernel: on SM90, where it measured faster, when the LSE or
    ``pv_dtype`` fp8 or ``qk_balance`` is needed, and without the package), ``("package", "")``
    (sageattention) or ``(None, reason)``.  The names are keys of ``backends.sage.SAGE_IMPLS``."""
    has_pkg = platform.has_package("sageattention")
    if (platform.sm == 90 and platform.has_package("triton") and pv_dtype == "fp16"
            and (head_dim is None or head_dim in SAGE_SM90_HEAD_DIMS)):
        return "sm90", ""  # measured fastest on the H200 (docs/benchmarks.md section 2)
    intree = platform.has_package("triton") and (head_dim is None or head_dim in SAGE_INTREE_HEAD_DIMS)
    pkg_broken = has_pkg and platform.sm == 90 and sage_lacks_sm90_fix(platform)
    # the package returns no LSE, picks its own P.V precision and quantizes Q / K its own way
    pkg_fits = not needs_lse and pv_dtype == "fp16" and not qk_balance
    if intree and (not pkg_fits or not has_pkg or platform.sm == 90):
        return "triton", ""
    if has_pkg and pkg_fits and not pkg_broken:
        return "package", ""
    why_intree = ("the in-tree INT8 kernel needs Triton" if not platform.has_package("triton") else
                  f"the in-tree INT8 kernel supports head dims {'/'.join(map(str, SAGE_INTREE_HEAD_DIMS))}, "
                  f"not {head_dim}")
    if not has_pkg:
        return None, f"{why_intree}, and package 'sageattention' is not installed; install: pip install sageattention"
    if pkg_broken:
        ver = platform.package_version("sageattention")
        return None, (f"{why_intree}, and sageattention {ver} lacks the upstream SM90 binding fix on Hopper "
                      f"(install: {SAGE_SM90_FIX_INSTALL})")
    if needs_lse:
        return None, f"{why_intree}, and the sageattention package returns no LSE (ring attention needs it)"
    if qk_balance:
        return None, f"{why_intree}, and the sageattention package has no qk_balance"
    return None, f"{why_intree}, and the sageattention package has no pv_dtype {pv_dtype} (fp16 only)"


def _sage_check(spec, req, platform):
    if platform.name == "musa" and req.needs_lse:
        return ["on MUSA sage_attn runs the sageattention package, which returns no LSE (ring attention needs it)"]
    if platform.name != "cuda" or spec.runtime_on(platform) is None:
        return []  # off CUDA, or no runtime at all: platform_reasons already says why
    impl, why = sage_cuda_runtime(platform, req.head_dim, req.needs_lse)
    return [] if impl else [why]


def _fp8_sm120_check(spec, req, platform):
    out = []
    if req.causal:
        out.append("only non-causal attention")
    if req.batch is not None and req.batch != 1:
        out.append(f"only batch 1 (got {req.batch})")
    return out


_NONE = (Runtime(),)
_NO_FA_KERNEL = "ditattn has no FlashAttention kernel for {p} ({what} is not integrated)"
_CUDA_INTREE = {"cuda": (Runtime((), "in-tree Triton/FlexAttention"),), "cpu": (Runtime((), "in-tree PyTorch reference"),)}


def _spec(backend, **kw) -> BackendSpec:
    return BackendSpec(backend=backend, **kw)


SPECS: dict[B, BackendSpec] = {s.backend: s for s in [
    _spec(B.FA, kind="dense", summary="FlashAttention (FA4 CuTe DSL, FA3 or FA2, whichever is installed)",
          runtimes={"cuda": (Runtime(("flash_attn.cute",), "FlashAttention-4"),
                             Runtime(("flash_attn_interface",), "FlashAttention-3"),
                             Runtime(("flash_attn",), "FlashAttention-2")),
                    "rocm": (Runtime(("flash_attn",), "FlashAttention (ROCm build of flash-attn)"),),
                    "xpu": (Runtime((), "XPU flash attention", missing=_NO_FA_KERNEL.format(
                        p="XPU", what="the XPU flash attention of sgl-kernel-xpu")),),
                    "musa": (Runtime(("flash_attn",), "MUSA FlashAttention", missing=_NO_FA_KERNEL.format(
                        p="MUSA", what="a MUSA build of flash-attn")),),
                    "npu": (Runtime((), "NPU fused attention", missing=_NO_FA_KERNEL.format(
                        p="NPU", what="torch_npu's npu_fusion_attention")),)},
          seed_platforms=("cuda", "rocm", "xpu", "musa", "npu"),
          cuda_sm_min=80, returns_lse=True, varlen=True, drop_in=True,
          install_hint="pip install flash-attn-4 (SM90/SM100), or flash-attn (FA2; its ROCm build on ROCm)",
          notes="falls back to torch_sdpa (logged, recorded in the plan) when no FlashAttention runtime "
                "is installed or this build has no kernel path for the platform (CPU, MPS, XPU, MUSA, NPU)",
          extra_check=_fa_check),
    _spec(B.TORCH_SDPA, kind="dense", summary="PyTorch scaled_dot_product_attention",
          runtimes={p: _NONE for p in ("cpu", "cuda", "rocm", "xpu", "musa", "mps", "npu")},
          seed_platforms=("cuda", "rocm", "xpu", "musa", "mps", "npu"),
          dtypes=ALL_FLOAT, max_head_dim=None, returns_lse=True, accepts_bias=True, drop_in=True,
          notes="the most portable option; LSE through the aten flash/efficient ops"),
    _spec(B.TORCH_CUDNN_SDPA, kind="dense", summary="PyTorch SDPA pinned to the cuDNN kernel",
          runtimes={"cuda": _NONE}, seed_platforms=("cuda",), cuda_sm_min=80, returns_lse=True,
          notes="fastest SDPA kernel on Hopper (about 1.6x torch's flash path at head dim 128)"),
    _spec(B.SLIDING_TILE_ATTN, kind="sparse", summary="Sliding Tile Attention (3-D tile windows per step/layer/head)",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=ALL_FLOAT, cross_attention=False,
          causal=False, lossy=True, config_schema="sliding_tile_attn",
          notes="in-tree block-sparse engine (any resolution; upstream st_attn not needed); "
                "mask_strategy_file_path required"),
    _spec(B.SAGE_ATTN, kind="quantized", summary="SageAttention: INT8 Q.K with smoothed K, FP16/FP8 P.V",
          runtimes={"cuda": (Runtime(("triton",), "in-tree Triton INT8 kernel"),
                             Runtime(("sageattention",), "sageattention package"),
                             Runtime(("triton.experimental.gluon",), "in-tree Gluon SM90 kernel")),
                    "musa": (Runtime(("sageattention",), "sageattention package"),),
                    "cpu": (Runtime((), "in-tree PyTorch reference"),)},
          seed_platforms=("cuda", "musa"), cpu_dtypes=ALL_FLOAT,
          cuda_sm=(80, 86, 89, 90, 120), lossy=True, returns_lse=True, drop_in=True, max_head_dim=128,
          install_hint="pip install sageattention", config_schema="sage_attn",
          notes="lossy (INT8 Q.K); upstream SM list SM80/86/89/90/120; on Hopper a call the in-tree kernel "
                "cannot serve falls back to fa when the installed sageattention lacks the SM90 fix; "
                "on MUSA it runs the sageattention package (no LSE)",
          extra_check=_sage_check),
    _spec(B.SAGE_ATTN_3, kind="quantized", summary="SageAttention3 (FP4 microscaling), Blackwell only",
          runtimes={"cuda": (Runtime(("sageattn3",), "SageAttention3"),)}, seed_platforms=("cuda",),
          cuda_sm=(100, 103, 120, 121), lossy=True, drop_in=True,
          install_hint="build SageAttention3 from its upstream repository (Blackwell GPUs only)"),
    _spec(B.SPARGE_ATTN, kind="sparse+quantized", summary="SpargeAttention: top-k blocks by pooled-query block scores, INT8 Q.K in kept blocks",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=FP16_BF16,
          cuda_sm=(80, 86, 87, 89, 90), lossy=True, cross_attention=False, causal=False,
          config_schema="sparge_attn",
          notes="FP16/BF16; head dim 64/128, square self-attention of >=128 tokens; other shapes run dense SDPA; "
                "kept blocks INT8 Q.K (quantize=false: exact)"),
    _spec(B.SOL_ATTN, kind="sparse", summary="Sol attention: threshold routing with exact KV sinks",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=BF16, head_dims=frozenset({128}),
          lossy=True, cross_attention=False, causal=False, config_schema="sol_attn",
          notes="BF16 and head dim 128 only; first dense_steps steps and dense_layers run dense_backend"),
    _spec(B.VIDEO_SPARSE_ATTN, kind="sparse", summary="Video Sparse Attention: coarse top-k tiles + fine attention",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
          cross_attention=False, causal=False, config_schema="video_sparse_attn",
          notes="4x4x4 tiles of 64 tokens; in-tree engine (upstream vsa not needed)"),
    _spec(B.SUBBLOCK_SPARSE_ATTN, kind="sparse", summary="Training-free SubBlock sparsity for MiniMax-H3",
          runtimes={"cuda": (Runtime((), "MiniMax-H3 kernels"),)},
          missing_kernel="not available yet: the MiniMax-H3 kernels follow once an H3 checkpoint is supported (DESIGN 2.10)",
          seed_platforms=("cuda",), cuda_sm=(90, 100, 120), lossy=True, cross_attention=False,
          config_schema="subblock_sparse_attn",
          install_hint="not available yet: needs a MiniMax-H3 checkpoint and its kernels (DESIGN 2.10)",
          notes="compute_mode bf16, or sage_fp8 on SM90 (needs SpargeAttn)"),
    _spec(B.VIDEO_SPARSE_ATTN_H3, kind="sparse", summary="VSA for MiniMax-H3 / FastH3 (gated compression branch)",
          runtimes={"cuda": (Runtime((), "MiniMax-H3 kernels"),)},
          missing_kernel="not available yet: the MiniMax-H3 kernels follow once an H3 checkpoint is supported (DESIGN 2.10)",
          seed_platforms=("cuda",), cuda_sm=(90, 100, 103), lossy=True, cross_attention=False,
          config_schema="video_sparse_attn_h3",
          install_hint="not available yet: needs a MiniMax-H3 checkpoint (DESIGN 2.10)",
          notes="rejects ring > 1, torch.compile, captured CUDA graphs; text encoder stays SDPA"),
    _spec(B.HYBRID_WINDOW_ATTN_H3, kind="sparse+linear", summary="VDN-H3 hybrid window softmax + Video Delta linear branch",
          runtimes={"cuda": (Runtime((), "MiniMax-H3 kernels"),)},
          missing_kernel="not available yet: the MiniMax-H3 kernels follow once an H3 checkpoint is supported (DESIGN 2.10)",
          seed_platforms=("cuda",), cuda_sm=(80, 86, 89, 90, 100, 103, 120), lossy=False,
          cross_attention=False, config_schema="hybrid_window_attn_h3",
          install_hint="not available yet: needs a VDN-H3 checkpoint (DESIGN 2.10)",
          notes="required by VDN-H3 weights; rejects base H3/FastH3 checkpoints, ring > 1, torch.compile"),
    _spec(B.VMOBA_ATTN, kind="sparse", summary="V-MoBA: top-k temporal/spatial/spatio-temporal chunks",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
          cross_attention=False, causal=False, config_schema="vmoba_attn"),
    _spec(B.AITER, kind="dense", summary="AMD aiter flash attention (ROCm only)",
          runtimes={"rocm": (Runtime(("aiter",), "aiter"),)}, seed_platforms=("rocm",), returns_lse=True,
          install_hint="pip install aiter (ROCm)"),
    _spec(B.AITER_SAGE, kind="quantized", summary="AMD aiter Sage attention (ROCm only)",
          runtimes={"rocm": (Runtime(("aiter",), "aiter"),)}, seed_platforms=("rocm",), lossy=True,
          missing_kernel="needs a ROCm GPU with aiter; this build has no aiter Sage bindings",
          install_hint="pip install aiter (ROCm)"),
    _spec(B.SLA_ATTN, kind="sparse+linear", summary="Sparse-Linear Attention: exact critical blocks + linear branch",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
          cross_attention=False, causal=False, config_schema="sla_attn",
          notes="linear branch projection from the checkpoint; zero when absent (pure sparse)"),
    _spec(B.SAGE_SLA_ATTN, kind="sparse+linear", summary="SageAttention + Sparse-Linear Attention (quantized sparse branch)",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
          cross_attention=False, causal=False, config_schema="sla_attn"),
    _spec(B.SPARSE_VIDEO_GEN_2_ATTN, kind="sparse", summary="Sparse-VideoGen2: k-means semantic permutation + block sparsity",
          runtimes=_CUDA_INTREE, seed_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
          cross_attention=False, causal=False, config_schema="sparse_video_gen_2_attn"),
    _spec(B.LASER_ATTN, kind="sparse", summary="Laser attention (Ascend NPU only)",
          runtimes={"npu": (Runtime(("sgl_kernel_npu",), "sgl_kernel_npu attentions"),)}, seed_platforms=("npu",),
          missing_kernel="needs an Ascend NPU with sgl_kernel_npu's attentions; this build has no NPU bindings",
          lossy=True, cross_attention=False, install_hint="pip install sgl_kernel_npu (Ascend NPU)",
          notes="uses SDPA below 2048 tokens"),
    _spec(B.BLOCK_SPARSE_ATTN, kind="sparse", summary="Block sparse attention (Ascend NPU only)",
          runtimes={"npu": (Runtime(("sgl_kernel_npu",), "sgl_kernel_npu attentions"),)}, seed_platforms=("npu",),
          missing_kernel="needs an Ascend NPU with sgl_kernel_npu's attentions; this build has no NPU bindings",
          lossy=True, cross_attention=False, install_hint="pip install sgl_kernel_npu (Ascend NPU)",
          config_schema="block_sparse_attn"),
    _spec(B.RAIN_FUSION_ATTN, kind="sparse", summary="RainFusion attention (Ascend NPU only)",
          runtimes={"npu": (Runtime(("sgl_kernel_npu",), "sgl_kernel_npu attentions"),)}, seed_platforms=("npu",),
          missing_kernel="needs an Ascend NPU with sgl_kernel_npu's attentions; this build has no NPU bindings",
          lossy=True, cross_attention=False, install_hint="pip install sgl_kernel_npu (Ascend NPU)"),
    _spec(B.FP8_FA_SM120, kind="quantized", summary="FP8 (E4M3) dense attention in CuTe DSL for SM120 GPUs",
          runtimes={"cuda": (Runtime(("flash_attn.cute",), "CuTe DSL"),)}, seed_platforms=("cuda",),
          missing_kernel="needs an SM120 GPU (RTX 50 / RTX PRO Blackwell); the SM120 FP8 CuTe kernel is not part of this build",
          dtypes=BF16, head_dims=frozenset({128}), cuda_sm=(120,), lossy=True, causal=False,
          install_hint="pip install flash-attn-4 (provides the CuTe DSL runtime); SM120 GPUs only",
          notes="opt-in; ~5% relative RMS vs BF16; other devices and calls use torch_cudnn_sdpa",
          extra_check=_fp8_sm120_check),
]}

assert set(SPECS) == set(B), "every backend needs a spec"


def get_spec(backend) -> BackendSpec:
    return SPECS[B.from_name(backend)]
