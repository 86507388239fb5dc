"""Backends ditattn names but has no kernel for in this build: each is declared with its capability
row (whose ``missing_kernel`` says why it cannot run) and, where it has parameters, their schema, so
that ``ditattn backends``, validation and the plan describe them like any other.

* the MiniMax-H3 family (``subblock_sparse_attn``, ``video_sparse_attn_h3``, ``hybrid_window_attn_h3``):
  its kernels follow once an H3 checkpoint is supported;
* platform bindings not integrated: ``aiter_sage`` (ROCm), ``laser_attn`` / ``block_sparse_attn`` /
  ``rain_fusion_attn`` (Ascend NPU), ``fp8_fa_sm120`` (SM120 FP8 CuTe DSL kernel; the platform
  substitutes ``torch_cudnn_sdpa`` for it).

Giving one of them a kernel: move its declaration into the module of the implementation and
decorate the function with ``register`` instead.
"""

from __future__ import annotations

from ditattn.attention.backends.base import declare
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import P, in_range, list_len, non_negative, positive  # noqa: F401
from ditattn.attention.specs import BF16, BackendSpec, Runtime


def _fp8_sm120_check(spec, req, platform):
    out = []
    if req.causal:
        out.append("only non-causal attention")
    if req.batch is not None and req.batch != 1:
        out.append(f"only batch 1 (got {req.batch})")
    return out


VIDEO_SPARSE_ATTN_H3_SCHEMA = (
    P(
        "VSA_sparsity",
        "float",
        0.9,
        "Fraction of video tiles excluded from top-k",
        check=in_range(0.0, 1.0),
        accepted="a number in [0, 1]",
    ),
    P(
        "vsa_mode",
        "str",
        "exempt",
        "exempt: non-video keys always selected; compete: they compete in top-k",
        choices=("exempt", "compete"),
    ),
    P(
        "vsa_dense_first_n_steps",
        "int",
        0,
        "Dense attention for the first N denoising steps",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "vsa_dense_layers",
        "list[int]",
        [],
        "Layer indices kept dense, e.g. [0, 1]",
        check=lambda v: None if all(i >= 0 for i in v) else "indices must be >= 0",
        accepted="a list of non-negative integers",
    ),
    P("vsa_tile_size", "int", 64, "Kernel tile size; only 64 (the trained (4,4,4) geometry)", choices=(64,)),
)

HYBRID_WINDOW_ATTN_H3_SCHEMA = (
    P(
        "vdn_h3_dense_smoke",
        "bool",
        False,
        "Allow a dense transformer backend (fa) on VDN-H3 weights for base-H3 + LoRA parity smoke tests (skips gates "
        "and linear branch)",
    ),
    P(
        "vdn_max_gather_rows",
        "int",
        200000,
        "Upper bound of K/V rows gathered per windowed FlashAttention call",
        check=positive,
        accepted="an integer > 0",
    ),
)

SUBBLOCK_SPARSE_ATTN_SCHEMA = (
    P("compute_mode", "str", "bf16", "bf16, or sage_fp8 (SM90 only, needs SpargeAttn)", choices=("bf16", "sage_fp8")),
)

BLOCK_SPARSE_ATTN_SCHEMA = (
    P(
        "skip_first_steps",
        "int",
        10,
        "Steps that use laser attention before switching to sparse",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "sparsity",
        "float",
        0.2,
        "Sparsity coefficient",
        check=in_range(0.0, 1.0, lo_open=True, hi_open=True),
        accepted="a number in (0, 1)",
    ),
)

#: the MiniMax-H3 family's runtime row and reason (no kernels until an H3 checkpoint is supported)
H3_KERNELS = dict(
    runtimes={"cuda": (Runtime((), "MiniMax-H3 kernels"),)},
    missing_kernel="not available yet: the MiniMax-H3 kernels follow once an H3 checkpoint is supported",
)

declare(
    B.SUBBLOCK_SPARSE_ATTN,
    schema=SUBBLOCK_SPARSE_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="sparse",
        summary="Training-free SubBlock sparsity for MiniMax-H3",
        **H3_KERNELS,
        upstream_platforms=("cuda",),
        cuda_sm=(90, 100, 120),
        lossy=True,
        cross_attention=False,
        config_schema="subblock_sparse_attn",
        install_hint="not available yet: needs a MiniMax-H3 checkpoint and its kernels",
        notes="compute_mode bf16, or sage_fp8 on SM90 (needs SpargeAttn)",
    ),
)
declare(
    B.VIDEO_SPARSE_ATTN_H3,
    schema=VIDEO_SPARSE_ATTN_H3_SCHEMA,
    spec=BackendSpec(
        kind="sparse",
        summary="VSA for MiniMax-H3 / FastH3 (gated compression branch)",
        **H3_KERNELS,
        upstream_platforms=("cuda",),
        cuda_sm=(90, 100, 103),
        lossy=True,
        cross_attention=False,
        config_schema="video_sparse_attn_h3",
        install_hint="not available yet: needs a MiniMax-H3 checkpoint",
        notes="rejects ring > 1, torch.compile, captured CUDA graphs; text encoder stays SDPA",
    ),
)
declare(
    B.HYBRID_WINDOW_ATTN_H3,
    schema=HYBRID_WINDOW_ATTN_H3_SCHEMA,
    spec=BackendSpec(
        kind="sparse+linear",
        summary="VDN-H3 hybrid window softmax + Video Delta linear branch",
        **H3_KERNELS,
        upstream_platforms=("cuda",),
        cuda_sm=(80, 86, 89, 90, 100, 103, 120),
        lossy=False,
        cross_attention=False,
        config_schema="hybrid_window_attn_h3",
        install_hint="not available yet: needs a VDN-H3 checkpoint",
        notes="required by VDN-H3 weights; rejects base H3/FastH3 checkpoints, ring > 1, torch.compile",
    ),
)
declare(
    B.AITER_SAGE,
    spec=BackendSpec(
        kind="quantized",
        summary="AMD aiter Sage attention (ROCm only)",
        runtimes={"rocm": (Runtime(("aiter",), "aiter"),)},
        upstream_platforms=("rocm",),
        lossy=True,
        missing_kernel="needs a ROCm GPU with aiter; this build has no aiter Sage bindings",
        install_hint="pip install aiter (ROCm)",
    ),
)
declare(
    B.LASER_ATTN,
    spec=BackendSpec(
        kind="sparse",
        summary="Laser attention (Ascend NPU only)",
        runtimes={"npu": (Runtime(("sgl_kernel_npu",), "sgl_kernel_npu attentions"),)},
        upstream_platforms=("npu",),
        missing_kernel="needs an Ascend NPU with sgl_kernel_npu's attentions; this build has no NPU bindings",
        lossy=True,
        cross_attention=False,
        install_hint="pip install sgl_kernel_npu (Ascend NPU)",
        notes="uses SDPA below 2048 tokens",
    ),
)
declare(
    B.BLOCK_SPARSE_ATTN,
    schema=BLOCK_SPARSE_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="sparse",
        summary="Block sparse attention (Ascend NPU only)",
        runtimes={"npu": (Runtime(("sgl_kernel_npu",), "sgl_kernel_npu attentions"),)},
        upstream_platforms=("npu",),
        missing_kernel="needs an Ascend NPU with sgl_kernel_npu's attentions; this build has no NPU bindings",
        lossy=True,
        cross_attention=False,
        install_hint="pip install sgl_kernel_npu (Ascend NPU)",
        config_schema="block_sparse_attn",
    ),
)
declare(
    B.RAIN_FUSION_ATTN,
    spec=BackendSpec(
        kind="sparse",
        summary="RainFusion attention (Ascend NPU only)",
        runtimes={"npu": (Runtime(("sgl_kernel_npu",), "sgl_kernel_npu attentions"),)},
        upstream_platforms=("npu",),
        missing_kernel="needs an Ascend NPU with sgl_kernel_npu's attentions; this build has no NPU bindings",
        lossy=True,
        cross_attention=False,
        install_hint="pip install sgl_kernel_npu (Ascend NPU)",
    ),
)
declare(
    B.FP8_FA_SM120,
    spec=BackendSpec(
        kind="quantized",
        summary="FP8 (E4M3) dense attention in CuTe DSL for SM120 GPUs",
        runtimes={"cuda": (Runtime(("flash_attn.cute",), "CuTe DSL"),)},
        upstream_platforms=("cuda",),
        missing_kernel=(
            "needs an SM120 GPU (RTX 50 / RTX PRO Blackwell); the SM120 FP8 CuTe kernel is not part of this build"
        ),
        dtypes=BF16,
        head_dims=frozenset({128}),
        cuda_sm=(120,),
        lossy=True,
        causal=False,
        install_hint="pip install flash-attn-4 (provides the CuTe DSL runtime); SM120 GPUs only",
        notes="opt-in; ~5% relative RMS vs BF16; other devices and calls use torch_cudnn_sdpa",
        extra_check=_fp8_sm120_check,
    ),
)
