"""bench/common.py: the kernel-name categories of the profiled step (docs/benchmarks.md, DiT step)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
common = pytest.importorskip("common")


@pytest.mark.parametrize(
    "name,category",
    [
        ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object", "attention"),
        ("_sage_fwd_sm90", "attention"),  # was 'elementwise/other' once
        ("_quant_int8_rows", "attention"),
        ("_block_sparse_fwd_sm90", "attention"),
        ("_quantize_rows_kernel", "quantize"),
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT", "gemm"),
        ("_residual_norm_kernel", "norm"),
        ("Memset (Device)", "elementwise/other"),
    ],
)
def test_kernel_categories(name, category):
    assert common._category(name) == category
