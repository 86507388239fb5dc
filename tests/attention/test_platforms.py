"""Upstream's (SGLang) platform support matrix (every row) and each platform's automatic choice."""

import pytest
import torch

from ditattn.attention.context import AttentionSettings
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.selector import LayerSpec, select_backend
from ditattn.attention.specs import SPECS
from ditattn.platforms import KNOWN_PACKAGES, Platform, detect_platform

COLS = ("cuda", "rocm", "xpu", "musa", "mps", "npu")
# Upstream's (SGLang) platform support matrix of the attention backends: Y = supported.
UPSTREAM_MATRIX = {
    "fa": "YYYYNY",
    "torch_sdpa": "YYYYYY",
    "sliding_tile_attn": "YNNNNN",
    "sage_attn": "YNNYNN",
    "sage_attn_3": "YNNNNN",
    "sparge_attn": "YNNNNN",
    "sol_attn": "YNNNNN",
    "video_sparse_attn": "YNNNNN",
    "video_sparse_attn_h3": "YNNNNN",
    "sla_attn": "YNNNNN",
    "sage_sla_attn": "YNNNNN",
    "vmoba_attn": "YNNNNN",
    "aiter": "NYNNNN",
    "aiter_sage": "NYNNNN",
    "sparse_video_gen_2_attn": "YNNNNN",
    "laser_attn": "NNNNNY",
    "block_sparse_attn": "NNNNNY",
    "rain_fusion_attn": "NNNNNY",
    "fp8_fa_sm120": "YNNNNN",
}


def _platform_for(spec, name):
    cap = None
    if name == "cuda":
        cap = (9, 0)
        if spec.cuda_sm is not None and 90 not in spec.cuda_sm:
            cap = divmod(spec.cuda_sm[0], 10)
    return Platform.simulate(name, cap, KNOWN_PACKAGES)


@pytest.mark.parametrize("backend", sorted(UPSTREAM_MATRIX))
def test_upstream_platform_matrix_row(backend):
    spec = SPECS[B.from_name(backend)]
    assert spec.upstream_platforms == tuple(c for c, y in zip(COLS, UPSTREAM_MATRIX[backend]) if y == "Y")
    for col, yes in zip(COLS, UPSTREAM_MATRIX[backend]):
        reasons = spec.platform_reasons(_platform_for(spec, col))
        if yes == "N":
            assert reasons and f"not supported on {col}" in reasons[0], (backend, col, reasons)
        elif spec.missing_kernel:
            assert reasons == [spec.missing_kernel]  # registered, refused with the reason
        elif any(rt.missing for rt in spec.runtimes[col]):
            # upstream's runtime has no kernel path in this build: refused (or substituted) with the reason
            assert reasons == [rt.missing for rt in spec.runtimes[col]], (backend, col, reasons)
        else:
            assert reasons == [], (backend, col, reasons)


def test_every_backend_has_facts():
    for b in B:
        s = SPECS[b]
        assert s.kind and s.summary and s.runtimes
        if not s.cross_attention:
            assert s.sparse or s.kind.startswith("sparse")


def test_missing_package_reason_names_install_hint():
    spec = SPECS[B.SAGE_ATTN_3]
    r = spec.platform_reasons(Platform.simulate("cuda", (10, 0), ()))
    assert any("sageattn3" in x and "install" in x for x in r)
    r = SPECS[B.SAGE_ATTN].platform_reasons(Platform.simulate("cuda", (7, 5), ("triton",)))
    assert any("SM80/86/89/90/120" in x for x in r)


def test_fa_needs_sm80():
    r = SPECS[B.FA].platform_reasons(Platform.simulate("cuda", (7, 5), ("flash_attn",)))
    assert any("SM80+" in x for x in r)


def _auto(platform, dtype=torch.bfloat16, head_dim=128, ring=1, **kw):
    layer = LayerSpec(role="self", head_dim=head_dim, dtype=dtype, **kw)
    return select_backend(
        layer, component=None, settings=AttentionSettings(ring_degree=ring), platform=platform
    ).backend


def test_auto_cuda_follows_measurement():
    assert _auto(Platform.simulate("cuda", (9, 0), {"flash_attn.cute"})) == B.FA
    assert _auto(Platform.simulate("cuda", (9, 0), {"flash_attn_interface"})) == B.FA
    # FA2 only: cuDNN SDPA is faster than FA2 on Hopper (measured on the H200)
    assert _auto(Platform.simulate("cuda", (9, 0), {"flash_attn"})) == B.TORCH_CUDNN_SDPA
    assert _auto(Platform.simulate("cuda", (9, 0), ())) == B.TORCH_CUDNN_SDPA
    assert _auto(Platform.simulate("cuda", (9, 0), {"flash_attn.cute"}), dtype=torch.float32) == B.TORCH_SDPA
    assert _auto(Platform.simulate("cuda", (7, 5), {"flash_attn"})) == B.TORCH_SDPA


def test_auto_sm100_prefers_cudnn_for_dense_noncausal_half():
    p = Platform.simulate("cuda", (10, 0), {"flash_attn.cute"})
    assert _auto(p) == B.TORCH_CUDNN_SDPA
    assert _auto(p, causal=True) == B.FA


def test_auto_other_platforms():
    assert _auto(Platform.simulate("rocm", None, {"flash_attn"})) == B.FA
    assert _auto(Platform.simulate("rocm", None, ())) == B.TORCH_SDPA
    # XPU / MUSA / NPU: this build has no FlashAttention kernel path there, so fa is never chosen
    assert _auto(Platform.simulate("xpu")) == B.TORCH_SDPA
    assert _auto(Platform.simulate("xpu"), dtype=torch.float32) == B.TORCH_SDPA
    assert _auto(Platform.simulate("musa", None, {"flash_attn"})) == B.TORCH_SDPA
    assert _auto(Platform.simulate("musa", None, {"sageattention"})) == B.SAGE_ATTN
    assert _auto(Platform.simulate("musa", None, ())) == B.TORCH_SDPA
    assert _auto(Platform.simulate("mps")) == B.TORCH_SDPA
    assert _auto(Platform.simulate("npu")) == B.TORCH_SDPA
    assert _auto(Platform.simulate("npu"), ring=2) == B.TORCH_SDPA
    assert _auto(Platform.simulate("cpu"), dtype=torch.float32) == B.TORCH_SDPA


def test_mps_always_sdpa_even_when_fa_asked():
    p = Platform.simulate("mps")
    layer = LayerSpec(role="self", head_dim=64, dtype=torch.float16)
    d = select_backend(layer, component=None, settings=AttentionSettings(backend=B.FA), platform=p)
    assert d.backend == B.TORCH_SDPA and "mps" in d.fallback_reason


def test_detect_platform_here():
    p = detect_platform()
    assert p.name in ("cpu", "cuda", "rocm", "xpu", "musa", "mps", "npu")
    if not torch.cuda.is_available():
        assert p.name in ("cpu", "mps", "xpu", "npu", "musa")


def test_unknown_platform_name():
    from ditattn import AttentionConfigError

    with pytest.raises(AttentionConfigError, match="unknown platform"):
        Platform.simulate("tpu")


def test_backend_info_names_upstream_platforms_and_keeps_the_old_name_deprecated():
    from ditattn.registry import list_backends

    info = next(i for i in list_backends(Platform.simulate("cpu", None, ())) if i.name == "sage_attn")
    assert info.upstream_platforms == ("cuda", "musa")
    data = info.to_json()
    assert data["upstream_platforms"] == ("cuda", "musa") and "seed_platforms" not in data
    with pytest.warns(DeprecationWarning, match="upstream_platforms"):
        assert info.seed_platforms == info.upstream_platforms
