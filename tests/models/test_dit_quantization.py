"""8-bit DiT linears (``--dit-quantization``, :mod:`ditattn.models.quantization`) and 8-bit Wan
checkpoints (``--dit-weights``, :mod:`ditattn.models.wan.checkpoint`).

On CPU: the rule's result on the tiny and the 14B architecture (meta device), the platform checks
as one-line errors, torchao's INT8 path run numerically on the tiny DiT (output error and cosine
against float32 and bfloat16), the GELU-epilogue routing, the pipeline / CLI / server / compare /
sequence-parallel wiring, and FP8 / INT8 checkpoints in the ComfyUI/Kijai and LightX2V layouts
built here.  The fused FP8 activation quantizer (:mod:`ditattn.models.fp8_linear`) also runs here:
its PyTorch reference against the float64 formula and torchao, its Triton kernel in the interpreter,
and the FP8 linears / tiny DiT on torchao's FP8 weights (its hardware gate lifted) with
``torch._scaled_mm`` on the CPU.  FP8 on the GPU needs compute capability >= 8.9: those tests
(``-k gpu``) skip elsewhere.
"""

import copy
import functools
import importlib.util
import os

import numpy as np
import pytest
import torch

from ditattn.attention.context import component_scope
from ditattn.errors import AttentionConfigError
from ditattn.models import quantization as Q
from ditattn.platforms import Platform

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'ditattn[quant]')")
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(
    not (HAS_FP8_GPU and HAS_TORCHAO), reason="FP8 linears need torchao and a CUDA GPU of compute capability >= 8.9"
)
SMALL = dict(height=48, width=48, num_frames=5, num_inference_steps=2, seed=3)


def _tiny_folder() -> str:
    from ditattn.models.builtin import builtin_model_path

    return os.path.join(builtin_model_path("ditattn:tiny-wan"), "transformer")


def _dit(quantization="none", dtype=torch.float32, device="cpu", **kw):
    from ditattn.models.wan.transformer import load_wan_transformer

    with component_scope("transformer"):
        model = load_wan_transformer(_tiny_folder(), dtype=dtype, device=device, **kw)
    model.linear_quantization = Q.quantize_linears(model, quantization)
    return model


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 3, 16, 16, generator=g)  # latent grid 3 x 8 x 8 = 192 tokens
    txt = torch.randn(1, 16, 64, generator=g)
    return x.to(device), torch.tensor([500.0], device=device), txt.to(device)


def _run(model, dtype, device="cpu"):
    x, t, txt = _inputs(device)
    with torch.inference_mode():
        return model(x.to(dtype), t, txt.to(dtype)).float().cpu()


def _err(out, ref):
    rel = ((out - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    return rel, cos


# ------------------------------------------------------------------------------------------------
# the declared rule


def _meta_dit(**arch):
    from ditattn.models.wan.transformer import WanTransformer, WanTransformerConfig

    with component_scope("transformer"), torch.device("meta"):
        return WanTransformer(WanTransformerConfig(**arch), dtype=torch.bfloat16)


def test_rule_on_the_14b_architecture():
    """40 blocks: every block's 8 per-token GEMMs quantized; the embeddings, the cached text K/V and
    the final projection kept, each with its reason."""
    plan = Q.plan_linears(_meta_dit(num_layers=40), "fp8")
    assert len(plan.decisions) == 40 * 10 + 6
    assert len(plan.quantized) == 40 * 8
    groups = {r: names for q, r, names in plan.groups() if not q}
    assert groups["final projection (the prediction itself)"] == ["proj_out"]
    assert len(groups["cross-attention K/V of the text (once per generation, cached)"]) == 80
    assert sorted(groups["time embedding (one row per sample, float32)"]) == [
        "condition_embedder.time_embedder.linear_1",
        "condition_embedder.time_embedder.linear_2",
        "condition_embedder.time_proj",
    ]
    assert len(groups["text embedding (once per generation)"]) == 2
    quantized = set(plan.quantized)
    for i in (0, 39):
        for name in (
            "attn1.to_q",
            "attn1.to_k",
            "attn1.to_v",
            "attn1.to_out.0",
            "attn2.to_q",
            "attn2.to_out.0",
            "ffn.net.0.proj",
            "ffn.net.2",
        ):
            assert f"blocks.{i}.{name}" in quantized
    assert plan.describe().startswith("fp8: 320 of 406 linears quantized (160 self-attention projection, ")
    js = plan.to_json()
    assert js["quantized"] == 320 and sum(g["count"] for g in js["groups"]) == 406
    assert Q.plan_linears(_meta_dit(num_layers=2), "none").quantized == []


def test_rule_size_limits_are_declared_reasons():
    """Narrow GEMMs (the trained ditattn:shapes model is 32 wide) and widths that are not a multiple
    of 16 stay, with the reason; a custom rule is plain data."""
    narrow = Q.plan_linears(_meta_dit(num_layers=1, num_attention_heads=2, attention_head_dim=16, ffn_dim=64), "int8")
    assert narrow.quantized == []
    assert any(r == "small GEMM (fewer than 512 features)" for _, r, _ in narrow.groups())
    odd = Q.plan_linears(_meta_dit(num_layers=1, num_attention_heads=4, attention_head_dim=128, ffn_dim=1000), "int8")
    kept = {n: r for q, r, names in odd.groups() if not q for n in names}
    assert kept["blocks.0.ffn.net.0.proj"] == "features not a multiple of 16"
    everything = Q.LinearQuantRule(patterns=(("*", True, "all"),), min_features=16)
    assert len(Q.plan_linears(_meta_dit(num_layers=1), "int8", everything).quantized) == 16


# ------------------------------------------------------------------------------------------------
# what each mode needs: one line naming everything missing


@pytest.mark.parametrize(
    "mode, platform, dtype, expect",
    [
        ("none", Platform.simulate("cpu"), torch.float32, None),
        ("int8", Platform.simulate("cpu", packages=["torchao"]), torch.float32, None),
        ("int8", Platform.simulate("cuda", (8, 0), packages=["torchao"]), torch.bfloat16, None),
        ("fp8", Platform.simulate("cuda", (9, 0), packages=["torchao"]), torch.bfloat16, None),
        ("fp8", Platform.simulate("cuda", (8, 9), packages=["torchao"]), torch.bfloat16, None),
        ("int8", Platform.simulate("cpu"), torch.float32, ["torchao (not installed: pip install 'ditattn[quant]')"]),
        (
            "fp8",
            Platform.simulate("cuda", (8, 0), packages=["torchao"]),
            torch.bfloat16,
            ["compute capability >= 8.9", "cuda SM80"],
        ),
        (
            "fp8",
            Platform.simulate("cpu"),
            torch.float32,
            ["torchao", "NVIDIA GPU", "this run is on cpu", "--dtype bfloat16"],
        ),
        (
            "fp8",
            Platform.simulate("cuda", (9, 0), packages=["torchao"]),
            torch.float16,
            ["--dtype bfloat16", "float16"],
        ),
        ("int8", Platform.simulate("xpu", packages=["torchao"]), torch.bfloat16, ["a CPU or an NVIDIA GPU", "xpu"]),
    ],
)
def test_why_not(mode, platform, dtype, expect):
    reason = Q.why_not(mode, platform, dtype)
    if expect is None:
        assert reason is None
        Q.check_supported(mode, platform, dtype)
        return
    assert reason.startswith(f"--dit-quantization {mode} needs ") and "\n" not in reason
    for word in expect:
        assert word in reason
    with pytest.raises(AttentionConfigError, match="needs"):
        Q.check_supported(mode, platform, dtype)


def test_unknown_mode_is_refused():
    from ditattn.runconfig import DIT_QUANTIZATION, ModelConfig

    assert DIT_QUANTIZATION == Q.MODES  # the config's copy (it imports no torch)
    with pytest.raises(AttentionConfigError, match="accepted: none, fp8, int8"):
        Q.check_mode("fp4")
    with pytest.raises(AttentionConfigError, match="dit_quantization: expected one of none, fp8, int8"):
        ModelConfig(dit_quantization="fp4")


def _refused(capsys, argv) -> str:
    """Run the CLI, expect exit status 2 and one ``error:`` line on stderr; return that line."""
    from ditattn.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    assert rc == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
    return err[0]


def test_cli_refusals_are_one_line(capsys):
    """fp8 here (CPU, float32) and on a simulated A100 / H200 without torchao; a bad value; --backend
    diffusers; sequence parallelism refuses it before any rank starts."""
    cases = [
        (
            ["generate", "--prompt", "x", "--dit-quantization", "fp8"],
            ["needs", "compute capability >= 8.9", "this run is on cpu", "--dtype bfloat16"],
        ),
        (
            ["plan", "--dit-quantization", "fp8", "--platform", "cuda:80", "--platform-packages", "torchao"],
            ["compute capability >= 8.9", "SM80"],
        ),
        (["plan", "--dit-quantization", "fp8", "--platform", "cuda:90"], ["needs torchao", "ditattn[quant]"]),
        (["plan", "--dit-quantization", "fp4"], ["invalid choice", "fp8"]),
        (
            ["generate", "--prompt", "x", "--backend", "diffusers", "--dit-quantization", "int8"],
            ["--dit-quantization applies to the native pipeline only"],
        ),
        (["generate", "--prompt", "x", "--num-gpus", "2", "--dit-quantization", "fp8"], ["compute capability"]),
        (["serve", "--dit-quantization", "fp8", "--port", "1"], ["compute capability"]),
        # ditattn:shapes' GEMMs are all narrower than the rule's 512 features: int8 would change nothing
        (
            ["plan", "--model-path", "ditattn:shapes", "--dit-quantization", "int8"],
            ["selects none of this model's 66 linears", "small GEMM", "--dit-quantization none"],
        ),
        (
            [
                "compare",
                "--model-path",
                "ditattn:shapes",
                "--prompt",
                "x",
                "--variant",
                "a=torch_sdpa",
                "--variant",
                "b=torch_sdpa+int8",
            ],
            ["selects none of this model's 66 linears"],
        ),
    ]
    for argv, words in cases:
        err = _refused(capsys, argv)
        for w in words:
            assert w in err, (argv, err)


@pytest.fixture
def h200_machine(monkeypatch):
    """This process as on a machine with an SM90 GPU (PyTorch reports one; the detected platform is
    CUDA SM90 with torchao), whatever the real machine has; ``--device cpu`` still means the CPU."""
    import ditattn.platforms as P

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "simulated H200")
    h200 = P.Platform("cuda", "cuda", (9, 0), "simulated H200", packages=frozenset({"torchao"}))
    monkeypatch.setattr(P, "_detected", lambda: h200)
    with P.use_platform(h200):
        yield h200


@pytest.mark.gpu  # simulates its machine: not pinned to a CPU-only one
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--output-path", "never-written.png"],
        ["plan"],
        ["compare", "--prompt", "x", "--variant", "a=torch_sdpa", "--variant", "b=torch_sdpa+fp8"],
    ],
)
def test_fp8_on_the_cpu_of_a_gpu_machine_is_refused_in_one_line(capsys, h200_machine, tmp_path, argv):
    """``--device cpu`` on a machine whose GPU could run FP8: the check looks at the chosen device (the
    CPU), not at the machine, and refuses before loading, in one line."""
    quant = [] if argv[0] == "compare" else ["--dit-quantization", "fp8"]
    extra = ["--output-path", str(tmp_path)] if argv[0] == "compare" else []
    err = _refused(
        capsys, [*argv, *quant, *extra, "--model-path", "ditattn:tiny-wan", "--device", "cpu", "--dtype", "bfloat16"]
    )
    assert "--dit-quantization fp8 needs an NVIDIA GPU with compute capability >= 8.9" in err
    assert "this run is on cpu" in err
    assert not list(tmp_path.iterdir())


def test_plan_shows_the_rule(capsys):
    """``plan --platform cuda:90`` resolves what an H200 with torchao would quantize, without weights."""
    import json

    from ditattn.cli import main

    args = [
        "plan",
        "--model-path",
        "ditattn:tiny-wan",
        "--dit-quantization",
        "fp8",
        "--platform",
        "cuda:90",
        "--platform-packages",
        "torchao",
        "--dtype",
        "bfloat16",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "transformer linears: fp8, 16 of 26 quantized (8 self-attention projection, " in out
    assert "  kept blocks.{0-1}.attn2.to_k, blocks.{0-1}.attn2.to_v: cross-attention K/V" in out
    assert "  kept proj_out: final projection" in out
    assert "  activations: fused per-row quantizer for 16 of 16 linears" in out
    assert main(args + ["--json"]) == 0
    comp = next(c for c in json.loads(capsys.readouterr().out)["components"] if c["name"] == "transformer")
    assert comp["linear_quantization"]["quantized"] == 16 and comp["linear_quantization"]["mode"] == "fp8"
    assert comp["linear_quantization"]["activations"] == {
        "summary": "fused per-row quantizer for 16 of 16 linears",
        "torchao": [],
    }
    assert main(["plan", "--json"]) == 0  # without the flag the plan is unchanged
    assert all("linear_quantization" not in c for c in json.loads(capsys.readouterr().out)["components"])


# ------------------------------------------------------------------------------------------------
# torchao's INT8 path on CPU, numerically


@needs_torchao
def test_int8_tiny_dit_against_float32_and_bfloat16():
    """The INT8 DiT's output against the float32 and bfloat16 DiTs of the same weights: close (rel.
    error, cosine) but not identical (the quantized GEMMs ran), and exactly the selected linears
    hold quantized weights."""
    ref32 = _run(_dit(), torch.float32)
    ref16 = _run(_dit(dtype=torch.bfloat16), torch.bfloat16)
    q32_model = _dit("int8")
    assert sorted(n for n, m in Q.linears(q32_model) if not Q.plain_weight(m)) == sorted(
        q32_model.linear_quantization.quantized
    )
    assert len(q32_model.linear_quantization.quantized) == 16
    q32 = _run(q32_model, torch.float32)
    q16 = _run(_dit("int8", torch.bfloat16), torch.bfloat16)
    rel, cos = _err(q32, ref32)
    assert 1e-5 < rel < 1e-2 and cos > 0.9999, (rel, cos)
    rel16, cos16 = _err(q16, ref16)
    assert 1e-5 < rel16 < 2e-2 and cos16 > 0.999, (rel16, cos16)
    assert _err(q16, ref32)[0] < 2e-2
    print(f"int8 fp32: rel {rel:.2e} cos {cos:.6f}; int8 bf16 vs bf16: rel {rel16:.2e} cos {cos16:.6f}")


@needs_torchao
def test_each_quantized_linear_is_an_8bit_gemm():
    """Per layer: a quantized linear's output differs from the float GEMM by INT8 rounding (about
    1e-2 relative), the kept ones are untouched."""
    plain, q = _dit(), _dit("int8")
    x = torch.randn(4, 96, 512, generator=torch.Generator().manual_seed(1))
    for name in ("blocks.0.attn1.to_q", "blocks.1.ffn.net.2", "blocks.0.attn2.to_out.0"):
        a, b = plain.get_submodule(name)(x), q.get_submodule(name)(x)
        rel = ((a - b).norm() / a.norm()).item()
        assert 1e-4 < rel < 3e-2, (name, rel)
    assert torch.equal(plain.proj_out.weight, q.proj_out.weight)
    assert torch.equal(plain.blocks[0].attn2.to_k.weight, q.blocks[0].attn2.to_k.weight)


@needs_torchao
def test_gelu_epilogue_takes_plain_weights_only():
    """The cuBLASLt GELU epilogue reads ``proj.weight`` itself: a quantized projection goes through
    the module (its 8-bit GEMM) and the GELU after it, fused or not."""
    from ditattn.models.wan.transformer import _GeluProj

    everything = Q.LinearQuantRule(patterns=(("*", True, "all"),), min_features=16)
    proj = _GeluProj(64, 128)
    assert proj.gelu_epilogue(on_cuda=True) and not proj.gelu_epilogue(on_cuda=True, fused="torch")
    x = torch.randn(2, 32, 64)
    plain = proj(x)
    Q.quantize_linears(proj, "int8", everything)
    assert not Q.plain_weight(proj.proj) and not proj.gelu_epilogue(on_cuda=True)
    out = proj(x, "auto")
    assert torch.equal(out, proj(x, "torch"))
    assert 0 < ((out - plain).norm() / plain.norm()).item() < 3e-2


@needs_torchao
def test_fused_and_plain_ops_agree_under_int8():
    """``set_fused_ops(False)`` (plain PyTorch norms and GELU) against the default path, both INT8."""
    model = _dit("int8")
    fused = _run(model, torch.float32)
    plain = _run(model.set_fused_ops(False), torch.float32)
    assert _err(fused, plain)[0] < 1e-5


# ------------------------------------------------------------------------------------------------
# FP8: the fused per-row activation quantizer and the linears on it (models/fp8_linear.py), on CPU.
# torchao's FP8 weights are built here with its hardware gate lifted (the gate is for the GEMM; the
# weights are the GPU's), and torch._scaled_mm runs on the CPU, so the whole fused path runs here.

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="the Triton kernel runs on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)",
)


@functools.cache
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this PyTorch's CPU ``torch._scaled_mm`` takes per-row scales (older builds take one
    per-tensor scale only and stop at an internal assertion)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao's FP8 weight quantization on the CPU (``quantize_`` refuses without an SM89+ GPU).  These
    tests check the row-wise FP8 path with CPU arithmetic; a PyTorch whose CPU ``_scaled_mm`` has no
    per-row scales cannot run it (the product refuses FP8 on the CPU in any case, see the refusal tests;
    the GPU tests below cover the real path)."""
    if not _cpu_rowwise_scaled_mm():
        pytest.skip(f"PyTorch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
    Q._torchao_quantization()
    import torchao.quantization.quant_api as qa

    monkeypatch.setattr(qa, "_check_hardware_support", lambda granularity: None)


def _activations(m, k, seed=0):
    """``[m, k]`` bf16 rows spanning 1e-3 .. 1e3, an all-zero row, a row with values near bf16's
    largest (half of it zero), a row of tiny (1e-30) values and an outlier (for ``m < 5``, the first
    ``m`` rows of the five-row draw)."""
    n = max(m, 5)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[1] = 0
    x[2, : k // 2] = 3e38 * torch.rand(k // 2, generator=g)
    x[3] = torch.randn(k, generator=g) * 1e-30
    x[4, 5] = 1e4
    return x[:m].to(torch.bfloat16)


def _formula64(x, gelu=False):
    """The quantizer's formula in float64, rounded once where the kernel rounds (bf16 scale, e4m3)."""
    x64 = x.double()
    if gelu:
        u = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
        x64 = (0.5 * x64 * (1 + torch.tanh(u))).to(torch.bfloat16).double()
    scale = (x64.abs().amax(-1, keepdim=True).clamp(min=448 * 2.0**-126) / 448).to(torch.bfloat16).double()
    return (x64 / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()


def _codes(q):
    return q.view(torch.uint8)


@pytest.mark.parametrize("m, k", [(37, 200), (5, 72), (9, 4500)])
def test_fp8_quantizer_reference_is_the_formula_and_torchao(m, k):
    """The PyTorch reference against the float64 formula (bit for bit) and against torchao's own
    per-row activation quantization (bit for bit on every row but the all-zero one, where torchao's
    scale is 0 and its row NaN: the one documented difference)."""
    from ditattn.models.fp8_linear import quantize_rows

    x = _activations(m, k)
    q, scale = quantize_rows(x, impl="torch")
    assert (
        q.shape == (m, k) and q.dtype == torch.float8_e4m3fn and scale.shape == (m, 1) and scale.dtype == torch.float32
    )
    q64, s64 = _formula64(x)
    assert torch.equal(_codes(q), _codes(q64)) and torch.equal(scale, s64)
    assert torch.equal(q[1].float(), torch.zeros(k)) and scale[1].item() > 0  # the zero row: zeros, finite
    assert q.float().abs().max() == 448  # each row's absmax lands on e4m3's largest value
    deq = q.float() * scale
    assert ((deq - x.float()).abs() <= x.float().abs() / 16 + scale * 2**-9 + 1e-37).all()  # e4m3: 3 mantissa bits
    if HAS_TORCHAO:
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows import Float8Tensor

        Q._torchao_quantization()
        ao = Float8Tensor.from_hp(x, granularity=PerRow())
        rows = torch.arange(m) != 1
        assert torch.equal(_codes(q[rows]), _codes(ao.qdata[rows])) and torch.equal(scale[rows], ao.scale[rows])
        assert ao.scale[1].item() == 0 and torch.isnan(ao.qdata[1].float()).all()
    q3, s3 = quantize_rows(x.view(1, m, k), impl="torch")  # leading dimensions flatten into rows
    assert torch.equal(_codes(q3), _codes(q)) and torch.equal(s3, scale)


def test_fp8_quantizer_refuses_what_it_does_not_take():
    from ditattn.models.fp8_linear import quantize_rows

    with pytest.raises(AttentionConfigError, match="expects bfloat16 activations, got torch.float32"):
        quantize_rows(torch.zeros(2, 16))
    with pytest.raises(AttentionConfigError, match="impl must be 'auto', 'triton' or 'torch'"):
        quantize_rows(torch.zeros(2, 16, dtype=torch.bfloat16), impl="cuda")
    with pytest.raises(AttentionConfigError, match="empty rows"):
        quantize_rows(torch.zeros(2, 0, dtype=torch.bfloat16))


def test_fp8_quantizer_gelu_reference_is_gelu_then_quantize():
    """``gelu=True`` is the model's tanh-GELU (rounded to bf16) then the quantizer, and the float64
    formula of both."""
    from ditattn.models.fp8_linear import quantize_rows

    x = (torch.randn(11, 96, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    q, scale = quantize_rows(x, gelu=True, impl="torch")
    q2, scale2 = quantize_rows(torch.nn.functional.gelu(x, approximate="tanh"), impl="torch")
    assert torch.equal(_codes(q), _codes(q2)) and torch.equal(scale, scale2)
    q64, s64 = _formula64(x, gelu=True)
    assert (_codes(q) != _codes(q64)).float().mean() < 0.01 and torch.equal(scale, s64)


def _bf16_steps(a, b):
    """``|a - b|`` in bf16 steps (``a``, ``b`` bf16; +0 and -0 are the same point)."""

    def key(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (key(a) - key(b)).abs()


def _ordered(q):
    """e4m3 codes as integers ordered like their values (+0 and -0 equal): steps apart = difference."""
    c = _codes(q).to(torch.int32)
    return torch.where(c >= 128, -(c - 128), c)


def _gelu64(x):
    """The tanh-GELU in float64 as ``x * sigmoid(2u)``: ``F.gelu(approximate="tanh")``'s function without its
    ``1 + tanh(u)`` cancellation (which leaves float64 no correct digit below x = -7)."""
    x64 = x.double()
    return x64 / (1 + torch.exp(-2 * 0.7978845608028654 * (x64 + 0.044715 * x64**3)))


def _all_bf16():
    """Every finite bfloat16 value (65,280)."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x)]


def _snapped_quotient_codes(x, inv):
    """The kernel's quantization arithmetic in PyTorch: ``x * inv``, its float32 bits rounded to 17
    significant bits, cast to e4m3 (codes; no clamp: within a row |x * inv| < 449)."""
    from ditattn.models.fp8_linear import SNAP_HALF, SNAP_MASK

    q = x * inv
    return (
        ((q.view(torch.int32) + SNAP_HALF) & SNAP_MASK).view(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    )


def test_fp8_quantizer_reciprocal_rounds_like_the_division():
    """The kernel multiplies by ``inv = 1 / scale`` (IEEE, once per row) instead of dividing each element;
    rounding the product to 17 significant bits first makes the e4m3 code equal the IEEE quotient's
    for every finite bf16 ``x`` and every bf16 scale mantissa at the extreme and middle exponents of
    the scales a row can have (2^-126 .. 2^119; 92 million pairs, those with |x / scale| < 449 -- a
    row's elements against its own scale -- compared; the 1.1e9 such pairs of all 32,512 positive
    normal bf16 scales agree as well, checked once off the suite).  Without the rounding the plain
    product misses the even neighbour on some exact ties x / scale = an e4m3 midpoint."""
    x = _all_bf16().float()
    plain_differs = compared = 0
    for e in (-126, -125, -64, -8, -1, 0, 1, 8, 64, 118, 119):
        s = ((128 + torch.arange(128, dtype=torch.float64)) / 128 * 2.0**e).float()[:, None]
        assert torch.equal(s.to(torch.bfloat16).float(), s)
        inv = 1.0 / s
        row = (x / s).abs() < 449
        ref = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert ((_snapped_quotient_codes(x, inv) == ref) | ~row).all(), e
        plain_differs += int(
            ((x * inv).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) != ref).logical_and_(row).sum()
        )
        compared += int(row.sum())
    assert plain_differs > 0 and compared > 20_000_000


def _ties(n_rows=12, seed=5):
    """Rows full of exact ties: x = (e4m3 midpoint) * scale for scales whose product stays in bf16,
    plus the element that sets the scale (the absmax 448 * scale)."""
    g = torch.Generator().manual_seed(seed)
    mids = torch.tensor(
        [m for k in range(-9, 6) for m in ((torch.arange(8) + 8.5) * 2.0**k).tolist()]
        + [(k + 0.5) * 2.0**-9 for k in range(8)],
        dtype=torch.float64,
    )
    mids = mids[mids < 448]
    rows = []
    for _ in range(n_rows):
        s = float(
            (torch.randint(128, 256, (1,), generator=g) // 32 * 32)
            * 2.0 ** (int(torch.randint(-40, 40, (1,), generator=g)) - 7)
        )
        x = torch.cat([mids, -mids]) * s  # a 3-bit scale mantissa keeps (5-bit midpoint) * scale in bf16
        keep = x.to(torch.bfloat16).double() == x.double()
        row = torch.cat([torch.tensor([448 * s]), x[keep]])
        rows.append(row[torch.randperm(row.numel(), generator=g)])
    k = min(r.numel() for r in rows)
    return torch.stack([r[:k] for r in rows]).to(torch.bfloat16)


@needs_interpreter
@pytest.mark.parametrize(
    "m, k", [(7, 1536), (3, 8960), (2, 13824), (5, 5120), (37, 33), (9, 4500), (6, 7), (2, 20000)]
)  # one pass (up to 16384 wide, 1-3 tiles), and the chunked loop
def test_fp8_quantizer_kernel_in_the_interpreter(m, k):
    """The Triton kernel (Triton's CPU interpreter) against the reference and the float64 formula: bit
    for bit, on rows with a zero row, values near bf16's largest, 1e-30 values and an outlier; with
    a row stride, and with 1, 2, 8 rows per program (the last program partly outside)."""
    from ditattn.models.fp8_linear import ONE_PASS_MAX, _quantize_rows_triton, quantize_rows

    assert (k <= ONE_PASS_MAX) == (k != 20000)
    x = _activations(m, k, seed=k)
    q64, s64 = _formula64(x)
    q, scale = quantize_rows(x, impl="triton")
    q0, s0 = quantize_rows(x, impl="torch")
    assert torch.equal(_codes(q), _codes(q0)) and torch.equal(scale, s0)
    assert torch.equal(_codes(q), _codes(q64)) and torch.equal(scale, s64)
    q, scale = quantize_rows(torch.cat([x, x], -1)[:, :k], impl="triton")  # rows with a stride
    assert torch.equal(_codes(q), _codes(q0)) and torch.equal(scale, s0)
    for rows in (1, 2, 8):
        q, scale = _quantize_rows_triton(x, False, 448 * 2.0**-126, rows=rows, num_warps=4)
        assert torch.equal(_codes(q), _codes(q0)) and torch.equal(scale, s0), rows


@needs_interpreter
def test_fp8_quantizer_kernel_rounds_ties_to_even():
    """Rows made of exact ties x / scale = an e4m3 midpoint: the kernel's codes are the IEEE quotient's
    (round half to even), where the plain product x * (1 / scale) would round some of them the other way."""
    from ditattn.models.fp8_linear import quantize_rows

    x = _ties()
    q, scale = quantize_rows(x, impl="triton")
    q0, s0 = quantize_rows(x, impl="torch")
    assert torch.equal(scale, s0) and torch.equal(_codes(q), _codes(q0))
    plain = (x.float() * (1.0 / s0)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (_codes(plain) != _codes(q0)).sum() > 0


if INTERPRETER or HAS_FP8_GPU:
    import triton
    import triton.language as tl

    from ditattn.models.fp8_linear import gelu_bf16

    @triton.jit
    def _gelu_probe_kernel(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, gelu_bf16(tl.load(X + offs, mask=offs < N, other=0.0)), mask=offs < N)


def _kernel_gelu(x):
    """The quantizer's GELU (``fp8_linear.gelu_bf16``) of ``x`` (bf16), through a one-line Triton kernel."""
    from ditattn.attention.kernels import check_device

    check_device(x, what="gelu probe")
    flat = x.contiguous().view(-1)
    y = torch.empty_like(flat)
    _gelu_probe_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, y, flat.numel(), BLOCK=1024)
    return y.view(x.shape)


def _check_gelu_bound(x):
    """The kernel's GELU of every finite bf16 ``x``: within one bf16 step of the correctly rounded
    float64 tanh-GELU, or within 2^-124 of it (results below that flush: 2^t overflows float32 for
    x < -10, float32 subnormals).  Returns how many results of magnitude >= 2^-124 differ at all."""
    g = _kernel_gelu(x).cpu()
    ref = _gelu64(x.cpu()).to(torch.bfloat16)
    steps = _bf16_steps(g, ref)
    tiny = (g.double() - ref.double()).abs() <= 2.0**-124
    assert ((steps <= 1) | tiny).all(), x.cpu()[(steps > 1) & ~tiny][:8]
    return int(((steps > 0) & (ref.double().abs() >= 2.0**-124)).sum())


@needs_interpreter
def test_fp8_gelu_against_float64():
    """The kernel's tanh-GELU ``x / (1 + 2^t)``, ``t = x (c1 + c2 x^2)``, for all 65,280 finite bf16
    inputs against the float64 tanh-GELU (``F.gelu(approximate="tanh")`` in float64 where its tanh form
    is exact to 1e-9, x > -5): one bf16 step at most, and (in the interpreter's exact float32 exp2 and
    division) on no input whose GELU is at least 2^-124 in magnitude."""
    import torch.nn.functional as F

    x = _all_bf16()
    big = x.double() > -5
    assert torch.allclose(F.gelu(x.double()[big], approximate="tanh"), _gelu64(x[big]), rtol=1e-9, atol=1e-300)
    assert _check_gelu_bound(x) == 0


@needs_interpreter
@pytest.mark.parametrize("m, k", [(3, 8960), (2, 13824), (5, 1536), (9, 33), (2, 20000)])
def test_fp8_quantizer_gelu_in_the_interpreter(m, k):
    """``gelu=True`` quantizes the kernel's own GELU exactly (bit for bit the reference on its output),
    and against the float64 formula (tanh-GELU rounded to bf16, then quantized): the same scales but for
    a one-bf16-step GELU difference on a row's absmax, codes within one e4m3 step, almost all equal."""
    import warnings

    from ditattn.models.fp8_linear import quantize_rows

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    x[0, :7] = torch.tensor([-12.0, -10.0, -6.0, 0.0, 3e38, -3e38, 1e-30])
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", RuntimeWarning
        )  # numpy's exp2 overflow for the negative tail (-> 0, as on GPUs)
        q, scale = quantize_rows(x, gelu=True, impl="triton")
        g = _kernel_gelu(x)
    q0, s0 = quantize_rows(g, impl="torch")
    assert torch.equal(_codes(q), _codes(q0)) and torch.equal(scale, s0)
    q64, s64 = _formula64(_gelu64(x).to(torch.bfloat16))
    assert (_bf16_steps(scale.to(torch.bfloat16), s64.to(torch.bfloat16)) <= 1).all()
    assert (_ordered(q) - _ordered(q64)).abs().max() <= 1
    assert (_codes(q) != _codes(q64)).float().mean() < 1e-3
    qf, sf = quantize_rows(torch.nn.functional.gelu(x, approximate="tanh"), impl="torch")  # F.gelu, then quantize
    assert (_bf16_steps(scale.to(torch.bfloat16), sf.to(torch.bfloat16)) <= 1).all()
    steps = (_ordered(q) - _ordered(qf)).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() < 2e-3


def test_fp8_quantizer_row_tiles():
    """The one-pass tiles are powers of two covering a row with little padding (none at 1536, 5120)."""
    from ditattn.models.fp8_linear import ONE_PASS_MAX, launch_config, row_tiles

    for k in list(range(1, 600)) + [1536, 4500, 5120, 8960, 13824, ONE_PASS_MAX]:
        tiles = [b for b in row_tiles(k) if b]
        assert all(b & (b - 1) == 0 for b in tiles) and sum(tiles) >= k and sum(tiles[:-1]) < k, k
        assert sum(tiles) - k < max(512, k / 4), k
    assert {k: row_tiles(k) for k in (1536, 5120, 8960, 13824)} == {
        1536: (1024, 512, 0),
        5120: (4096, 1024, 0),
        8960: (8192, 512, 512),
        13824: (8192, 4096, 2048),
    }
    assert launch_config(32760, 1536) == {"rows": 4, "num_warps": 8}
    assert launch_config(3, 33)["rows"] == 4 and launch_config(32760, 8960) == {"rows": 1, "num_warps": 8}


def _fp8_linear_layer(k=512, n=384, seed=0):
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.bias.normal_(generator=torch.Generator().manual_seed(seed))
    return lin.to(torch.bfloat16)


@needs_torchao
def test_fp8_linear_against_dequantized_reference_and_torchao(fp8_on_cpu):
    """One FP8 linear, fused path: the float64 GEMM of the dequantized operands plus bias within
    bf16 rounding, torchao's own forward (its activation quantization, the same torch._scaled_mm)
    bit for bit, and the bf16 linear within e4m3 rounding."""
    from ditattn.models.fp8_linear import fp8_linear, quantize_rows, takes_fused

    lin = _fp8_linear_layer()
    plain = copy.deepcopy(lin)
    Q.quantize_linears(lin, "fp8", Q.LinearQuantRule(patterns=(("*", True, "all"),), min_features=16))
    assert takes_fused(lin) and not takes_fused(lin, "torch") and not takes_fused(plain)
    x = _activations(7, 512)[4:].clone()  # rows 1e-1 .. 1e3 (an outlier in one)
    x = torch.cat([x, torch.randn(2, 5, 512).to(torch.bfloat16).flatten(0, 1)]).view(13, 1, 512)
    y = fp8_linear(x, lin)
    assert y.shape == (13, 1, 384) and y.dtype == torch.bfloat16
    q, scale = quantize_rows(x)
    w = lin.weight
    ref = (q.double() * scale.double()) @ (w.qdata.double() * w.scale.double()).t() + lin.bias.double()
    ref = ref.view(13, 1, 384)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + ref.abs().amax(-1, keepdim=True) * 1e-5).all()
    assert torch.equal(y, lin(x))  # torchao's path on the same operands
    rel = ((y.float() - plain(x).float()).norm() / plain(x).float().norm()).item()
    assert 1e-3 < rel < 5e-2, rel


@needs_torchao
def test_fp8_tiny_dit_quantizes_each_input_once(fp8_on_cpu, monkeypatch):
    """The tiny DiT with FP8 linears on CPU: 6 quantizer passes per block (self-attention input
    shared by q/k/v, its output, the cross-attention query input and output, the feed-forward
    input, the GELU-fused hidden) for 8 GEMMs, and the output equal, bit for bit, to torchao's own
    path (``set_fused_ops(False)``) on the same weights."""
    from ditattn.models import fp8_linear

    model = _dit("fp8", torch.bfloat16)
    plan = model.linear_quantization
    assert plan.torchao_activations == () and plan.activations() == "fused per-row quantizer for 16 of 16 linears"
    assert plan.describe().endswith("; activations: fused per-row quantizer for 16 of 16 linears")
    assert plan.to_json()["activations"] == {"summary": plan.activations(), "torchao": []}
    calls, gemms = [], []
    real_q, real_mm = fp8_linear.quantize_rows, fp8_linear.scaled_linear
    monkeypatch.setattr(fp8_linear, "quantize_rows", lambda x, **kw: calls.append(kw.get("gelu")) or real_q(x, **kw))
    monkeypatch.setattr(fp8_linear, "scaled_linear", lambda *a: gemms.append(a[2]) or real_mm(*a))
    fused = _run(model, torch.bfloat16)
    assert calls == [False, False, False, False, False, True] * 2 and len(gemms) == 16
    assert gemms[:3] == [model.blocks[0].attn1.to_q, model.blocks[0].attn1.to_k, model.blocks[0].attn1.to_v]
    calls.clear()
    ao = _run(model.set_fused_ops(False), torch.bfloat16)
    assert calls == [] and torch.equal(fused, ao)
    rel, cos = _err(fused, _run(_dit(dtype=torch.bfloat16), torch.bfloat16))
    assert 1e-4 < rel < 3e-2 and cos > 0.999, (rel, cos)


@needs_torchao
def test_fp8_unfused_lora_keeps_torchaos_path_and_the_plan_says_so(fp8_on_cpu, tmp_path):
    """An unfused LoRA adapter (LoRALinear) keeps torchao's activation path: listed with the reason in
    the plan and the log line, nothing silently replaced; its output still matches the fused model
    where the adapter's scale is 0."""
    from ditattn.models.lora import LoRALinear, apply_lora, lora_scales, parse_lora_spec, read_lora

    model = _dit(dtype=torch.bfloat16)
    apply_lora(model, read_lora(parse_lora_spec(_write_lora(tmp_path / "style.safetensors"))), fuse=False)
    assert isinstance(model.blocks[0].attn1.to_q, LoRALinear)
    meta = Q.plan_linears(model, "fp8")
    plan = Q.quantize_linears(model, "fp8")
    reason = "LoRALinear (e.g. an unfused LoRA adapter) runs its own forward"
    assert [n for n, _ in plan.torchao_activations] == ["blocks.0.attn1.to_q", "blocks.1.ffn.net.2"]
    assert {r for _, r in plan.torchao_activations} == {reason}
    assert [n for n, _ in meta.torchao_activations] == ["blocks.0.attn1.to_q", "blocks.1.ffn.net.2"]
    assert plan.activations() == f"fused per-row quantizer for 14 of 16 linears; torchao's own path for 2 ({reason})"
    with lora_scales({}):  # adapters off: torchao's path on two linears, the fused one elsewhere
        off = _run(model, torch.bfloat16)
    assert torch.equal(off, _run(_dit("fp8", torch.bfloat16), torch.bfloat16))
    assert not torch.equal(_run(model, torch.bfloat16), off)


# ------------------------------------------------------------------------------------------------
# the pipeline, the CLI, the server, compare, sequence parallelism


@needs_torchao
def test_pipeline_generate_and_summary(capsys):
    from ditattn.cli import main
    from ditattn.pipelines.wan import WanPipelineNative

    ref = WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cpu", dtype="float32")
    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", device="cpu", dtype="float32", dit_quantization="int8"
    )
    assert pipe.quantization_summary() == "int8 (16 of 26 linears)" and ref.quantization_summary() is None
    a = ref.generate("a red fox", output_type="latent", progress=False, **SMALL).frames
    b = pipe.generate("a red fox", output_type="latent", progress=False, **SMALL).frames
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 2e-2, rel
    assert (
        main(
            [
                "generate",
                "--model-path",
                "ditattn:tiny-wan",
                "--prompt",
                "a fox",
                "--dit-quantization",
                "int8",
                "--no-save-output",
                "--height",
                "32",
                "--width",
                "32",
                "--num-frames",
                "1",
                "--num-inference-steps",
                "1",
            ]
        )
        == 0
    )
    assert "DiT linears: int8 (16 of 26 linears)" in capsys.readouterr().out.strip().splitlines()[-1]


@needs_torchao
def test_int8_with_every_dense_backend_on_cpu():
    """The quantized linears are independent of the attention backend: dense, quantized and sparse
    attention (their CPU reference paths) all run with INT8 linears."""
    from ditattn.attention.context import AttentionSettings
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.pipelines.wan import WanPipelineNative

    for backend in ("torch_sdpa", "sage_attn", "sparge_attn"):
        pipe = WanPipelineNative.from_pretrained(
            "ditattn:tiny-wan",
            AttentionSettings(backend=AttentionBackendEnum.from_name(backend)),
            device="cpu",
            dtype="bfloat16",
            dit_quantization="int8",
        )
        res = pipe.generate("a fox", output_type="latent", progress=False, **SMALL)
        assert torch.isfinite(res.frames).all(), backend


@needs_torchao
def test_server_runs_quantized_and_requests_cannot_change_it():
    """``serve --dit-quantization int8``: per process; a request carrying the field is refused (it
    is not part of the request, so not of the batching signature)."""
    from fastapi.testclient import TestClient

    from ditattn.runconfig import RunConfig
    from ditattn.server.app import create_app
    from ditattn.server.runner import build_runner

    cfg = RunConfig.from_mapping(
        {
            "model_path": "ditattn:tiny-wan",
            "dit_quantization": "int8",
            "num_inference_steps": 1,
            "height": 32,
            "width": 32,
            "num_frames": 1,
            "batch_window_s": 0,
        }
    )
    runner = build_runner(cfg)
    assert runner.pipe.quantization_summary() == "int8 (16 of 26 linears)"
    with TestClient(create_app(runner, cfg.server), base_url="http://localhost") as client:
        r = client.post("/v1/images/generations", json={"prompt": "a boat", "size": "32x32"})
        assert r.status_code == 200, r.text
        r = client.post(
            "/v1/images/generations", json={"prompt": "a boat", "size": "32x32", "dit_quantization": "none"}
        )
        assert r.status_code == 400 and "dit_quantization" in r.text


def test_compare_variants_carry_the_quantization():
    from ditattn.evaluation.compare import parse_variant

    v = parse_variant("q=sage_attn:pv_dtype=fp8+fp8")
    assert (v.backend, v.dit_quantization, v.label()) == ("sage_attn", "fp8", "sage_attn:pv_dtype=fp8+fp8")
    assert parse_variant("q=auto+int8").dit_quantization == "int8"
    assert parse_variant('q={"backend": "fa", "dit_quantization": "int8"}').dit_quantization == "int8"
    assert parse_variant("ref=fa").dit_quantization == "none"
    with pytest.raises(AttentionConfigError, match="accepted: none, fp8, int8"):
        parse_variant('q={"backend": "fa", "dit_quantization": "fp4"}')


# ------------------------------------------------------------------------------------------------
# 8-bit checkpoints: ComfyUI/Kijai and LightX2V layouts, built here from the tiny DiT's weights

# diffusers -> original Wan names (the inverse of diffusers' convert_wan_transformer_to_diffusers)
TO_WAN = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".norm2.", ".norm3."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
]


def _wan_name(key: str) -> str:
    for a, b in TO_WAN:
        key = key.replace(a, b)
    if key == "scale_shift_table":
        return "head.modulation"
    return key.replace(".scale_shift_table", ".modulation")


def _fp8(w: torch.Tensor, per_channel: bool):
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    scale = (amax.float() / 448.0).clamp(min=1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def _int8(w: torch.Tensor):
    scale = (w.abs().amax(dim=1, keepdim=True).float() / 127.0).clamp(min=1e-12)
    return torch.round(w.float() / scale).clamp(-128, 127).to(torch.int8), scale


def _write(tmp_path, name, layout):
    """The tiny DiT's weights as ``layout``: ``comfy`` (Wan names under model.diffusion_model., per
    tensor float8 + scale_weight + scaled_fp8 marker), ``kijai`` (Wan names, plain float8 casts),
    ``lightx2v-fp8`` / ``lightx2v-int8`` (Wan names, per-channel weight_scale of the block
    linears, an input_scale), ``diffusers-fp8`` (diffusers names, per-channel weight_scale)."""
    from safetensors.torch import save_file

    sd = {k: v.float().contiguous() for k, v in _dit().state_dict().items()}
    out = {}
    for k, v in sd.items():
        name_k = k if layout == "diffusers-fp8" else _wan_name(k)
        if layout == "comfy":
            name_k = "model.diffusion_model." + name_k
        linear = k.endswith(".weight") and v.dim() == 2
        if linear and layout in ("comfy", "kijai") or (linear and k.startswith("blocks.")):
            base = name_k[: -len("weight")]
            if layout == "kijai":
                out[name_k] = v.to(torch.float8_e4m3fn)
            elif layout == "comfy":
                out[name_k], s = _fp8(v, per_channel=False)
                out[base + "scale_weight"] = s.reshape(1)
            elif layout == "lightx2v-int8":
                out[name_k], out[base + "weight_scale"] = _int8(v)
                out[base + "input_scale"] = torch.ones(1)
            else:  # lightx2v-fp8, diffusers-fp8
                out[name_k], out[base + "weight_scale"] = _fp8(v, per_channel=True)
        else:
            out[name_k] = v.to(torch.bfloat16)
    if layout == "comfy":
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / f"{name}.safetensors"
    save_file(out, str(path))
    return str(path), sd


@pytest.mark.parametrize(
    "layout, scales, tol",
    [
        ("comfy", {"per-tensor"}, 0.07),
        ("kijai", {"none"}, 0.07),
        ("lightx2v-fp8", {"per-channel"}, 0.07),
        ("lightx2v-int8", {"per-channel"}, 0.01),
        ("diffusers-fp8", {"per-channel"}, 0.07),
    ],
)
def test_eight_bit_checkpoint_layouts(tmp_path, layout, scales, tol):
    """Each layout loads into the native DiT: weights within the format's rounding of the originals
    (e4m3: 2^-4 relative, int8 per channel: half a step), the DiT output close to the original's."""
    from ditattn.models.wan.checkpoint import load_weights_file, to_native_state
    from ditattn.models.weights import target_dtype

    path, sd = _write(tmp_path, layout, layout)
    state, report = to_native_state(load_weights_file(path), lambda n: target_dtype(n, torch.float32))
    assert report.scales == scales and report.eight_bit > 0
    assert report.layout == ("diffusers" if layout == "diffusers-fp8" else "wan")
    assert set(state) == set(sd)
    w0, w = sd["blocks.0.attn1.to_q.weight"], state["blocks.0.attn1.to_q.weight"]
    assert 0 < ((w - w0).norm() / w0.norm()).item() < tol
    model = _dit(weights_file=path)
    rel, cos = _err(_run(model, torch.float32), _run(_dit(), torch.float32))
    assert rel < tol and cos > 0.99, (layout, rel, cos)


@needs_torchao
def test_fp8_checkpoint_then_int8_linears(tmp_path):
    """A LightX2V FP8 file loaded and quantized again at load time (``--dit-weights`` +
    ``--dit-quantization int8``) through the pipeline and the CLI."""
    from ditattn.cli import main
    from ditattn.pipelines.wan import WanPipelineNative

    path, _ = _write(tmp_path, "dit_fp8", "lightx2v-fp8")
    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", device="cpu", dtype="float32", dit_quantization="int8", dit_weights=path
    )
    ref = WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cpu", dtype="float32")
    a = ref.generate("a red fox", output_type="latent", progress=False, **SMALL).frames
    b = pipe.generate("a red fox", output_type="latent", progress=False, **SMALL).frames
    assert 0 < ((a - b).norm() / a.norm()).item() < 0.1
    assert (
        main(
            [
                "generate",
                "--model-path",
                "ditattn:tiny-wan",
                "--prompt",
                "a fox",
                "--dit-weights",
                path,
                "--dit-quantization",
                "int8",
                "--no-save-output",
                "--height",
                "32",
                "--width",
                "32",
                "--num-frames",
                "1",
                "--num-inference-steps",
                "1",
            ]
        )
        == 0
    )


def test_bad_checkpoints_are_one_line(tmp_path, capsys):
    from safetensors.torch import save_file

    from ditattn.models.wan.checkpoint import to_native_state

    f32 = lambda n: torch.float32  # noqa: E731
    w = torch.zeros(8, 4)
    cases = [
        ({"a.weight": torch.zeros(8, 2, dtype=torch.uint8)}, "packed 4-bit weight"),
        ({"a.weight": w.to(torch.int8)}, "int8 weight without a scale"),
        ({"a.weight": w.to(torch.float8_e4m3fn), "a.weight_scale": torch.ones(3)}, "scale of shape (3,)"),
        ({"a.weight": w, "b.scale_weight": torch.ones(1)}, "scale tensor(s) without an 8-bit weight"),
    ]
    for state, words in cases:
        with pytest.raises(AttentionConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            to_native_state(state, f32)
    path, _ = _write(tmp_path, "ok", "comfy")
    two = tmp_path / "two.safetensors"
    save_file({"blocks.0.attn1.to_q.weight": torch.zeros(4, 4)}, str(two))
    for argv, words in [
        (["--dit-weights", str(tmp_path / "missing.safetensors")], "does not exist"),
        (["--dit-weights", str(tmp_path / "x.bin")], "accepted: a .safetensors file"),
        (["--dit-weights", str(two)], "checkpoint does not match the model configuration"),
        (["--dit-weights", path, "--model-path", "ditattn:tiny-wan2.2"], "transformer=PATH,transformer_2=PATH"),
        (
            ["--dit-weights", f"transformer_3={path}", "--model-path", "ditattn:tiny-wan2.2"],
            "unknown DiT component 'transformer_3'",
        ),
    ]:
        assert words in _refused(capsys, ["generate", "--prompt", "x", "--no-save-output", *argv])


def test_eight_bit_weights_inside_a_diffusers_folder(tmp_path):
    """A diffusers folder whose transformer file holds FP8 weights with per-channel scales: loaded in
    bfloat16, each weight is dequantized with its scale (not cast as stored)."""
    import shutil

    from ditattn.models.builtin import builtin_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    folder = tmp_path / "wan-fp8"
    shutil.copytree(builtin_model_path("ditattn:tiny-wan"), folder)
    path, sd = _write(tmp_path, "dit", "diffusers-fp8")
    os.replace(path, folder / "transformer" / "diffusion_pytorch_model.safetensors")
    pipe = WanPipelineNative.from_pretrained(str(folder), device="cpu", dtype="bfloat16")
    w0 = sd["blocks.1.ffn.net.2.weight"]
    w = pipe.components["transformer"].blocks[1].ffn.net[2].weight.float()
    assert pipe.components["transformer"].blocks[1].ffn.net[2].weight.dtype == torch.bfloat16
    assert ((w - w0).norm() / w0.norm()).item() < 0.07


def test_two_dit_weights_files(tmp_path):
    """Wan 2.2's pair: ``transformer=FILE,transformer_2=FILE``; the folder's weights otherwise."""
    from ditattn.pipelines.wan import WanPipelineNative

    path, _ = _write(tmp_path, "dit", "comfy")
    spec = f"transformer={path},transformer_2={path}"
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan2.2", device="cpu", dtype="float32", dit_weights=spec)
    a, b = pipe.components["transformer"], pipe.components["transformer_2"]
    assert torch.equal(a.blocks[0].attn1.to_q.weight, b.blocks[0].attn1.to_q.weight)


# ------------------------------------------------------------------------------------------------
# FP8 on the GPU (skipped without an SM89+ GPU and torchao)


@needs_fp8_gpu
def test_fp8_tiny_dit_on_the_gpu():
    """FP8 against bfloat16 on the same weights, fused kernels (Triton norms; the GELU epilogue
    routed around the quantized GEMM) against plain ops, and torch.compile of the blocks."""
    from ditattn.models.wan.compile import compile_blocks

    ref = _run(_dit(dtype=torch.bfloat16, device="cuda"), torch.bfloat16, "cuda")
    model = _dit("fp8", torch.bfloat16, "cuda")
    assert not model.blocks[0].ffn.net[0].gelu_epilogue(on_cuda=True)
    assert model.linear_quantization.activations() == "fused per-row quantizer for 16 of 16 linears"
    out = _run(model, torch.bfloat16, "cuda")
    rel, cos = _err(out, ref)
    assert 1e-4 < rel < 3e-2 and cos > 0.999, (rel, cos)
    plain = _run(model.set_fused_ops(False), torch.bfloat16, "cuda")
    assert _err(out, plain)[0] < 1e-2
    compiled = _run(compile_blocks(model.set_fused_ops(True)), torch.bfloat16, "cuda")
    assert _err(compiled, out)[0] < 2e-2


@needs_fp8_gpu
@pytest.mark.parametrize("m, k", [(4095, 1536), (257, 8960), (33, 5120), (3, 13824), (5, 20000), (37, 33)])
def test_fp8_quantizer_kernel_on_the_gpu(m, k):
    """The Triton kernel on CUDA (one pass up to 16384 wide, the chunked loop beyond) against the
    reference and torchao's activation quantization: bit for bit (also on rows of exact ties); with
    the GELU: bit for bit the reference on the kernel's own GELU, and against the float64 formula
    (tanh-GELU rounded to bf16, then quantized): scales within one bf16 step, codes within one e4m3
    step, almost all equal."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows import Float8Tensor

    from ditattn.models.fp8_linear import quantize_rows

    x = _activations(m, k, seed=k).cuda()
    q, scale = quantize_rows(x)
    q0, s0 = quantize_rows(x, impl="torch")
    assert torch.equal(_codes(q), _codes(q0)) and torch.equal(scale, s0)
    ao = Float8Tensor.from_hp(x, granularity=PerRow())
    rows = torch.arange(m, device="cuda") != 1  # the all-zero row: torchao's is NaN
    assert torch.equal(_codes(q[rows]), _codes(ao.qdata[rows])) and torch.equal(scale[rows], ao.scale[rows])
    x = _ties().cuda()
    assert torch.equal(_codes(quantize_rows(x)[0]), _codes(quantize_rows(x, impl="torch")[0]))
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16).cuda()
    q, scale = quantize_rows(x, gelu=True)
    q0, s0 = quantize_rows(_kernel_gelu(x), impl="torch")
    assert torch.equal(_codes(q), _codes(q0)) and torch.equal(scale, s0)
    q64, s64 = _formula64(_gelu64(x.cpu()).to(torch.bfloat16))
    q, scale = q.cpu(), scale.cpu()
    assert (_bf16_steps(scale.to(torch.bfloat16), s64.to(torch.bfloat16)) <= 1).all()
    assert (_ordered(q) - _ordered(q64)).abs().max() <= 1
    assert (_codes(q) != _codes(q64)).float().mean() < 1e-3


@needs_fp8_gpu
def test_fp8_gelu_against_float64_on_the_gpu():
    """The GELU with the GPU's approximate exp2 (ex2.approx.ftz) and division (div.full) for all 65,280
    finite bf16 inputs: within one bf16 step of the correctly rounded float64 tanh-GELU (or 2^-124),
    and on few inputs at all."""
    assert _check_gelu_bound(_all_bf16().cuda()) < 200


@needs_fp8_gpu
def test_fp8_fused_linear_on_the_gpu():
    """One 1536-wide FP8 linear on CUDA: the fused path against torchao's own forward (the same
    codes and the same torch._scaled_mm: bit for bit), and the GELU-fused input against GELU then
    torchao's forward."""
    from ditattn.models.fp8_linear import fp8_linear

    lin = torch.nn.Linear(1536, 1536).to("cuda", torch.bfloat16)
    plan = Q.quantize_linears(lin, "fp8", Q.LinearQuantRule(patterns=(("*", True, "all"),)))
    assert plan.activations() == "fused per-row quantizer for 1 of 1 linears"
    x = torch.randn(3, 77, 1536, device="cuda").to(torch.bfloat16)
    y, ref = fp8_linear(x, lin), lin(x)
    assert y.shape == (3, 77, 1536) and torch.equal(y, ref), (y.float() - ref.float()).abs().max().item()
    y = fp8_linear(x, lin, gelu=True)
    ref = lin(torch.nn.functional.gelu(x, approximate="tanh"))
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@needs_fp8_gpu
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantized_pipeline_on_the_gpu(mode):
    from ditattn.pipelines.wan import WanPipelineNative

    ref = WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cuda", dtype="bfloat16")
    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", device="cuda", dtype="bfloat16", dit_quantization=mode
    )
    a = ref.generate("a red fox", output_type="latent", progress=False, **SMALL).frames
    b = pipe.generate("a red fox", output_type="latent", progress=False, **SMALL).frames
    assert 0 < ((a - b).norm() / a.norm()).item() < 5e-2
    assert np.isfinite(b.cpu().numpy()).all()


@needs_torchao
def test_sequence_parallel_int8_matches_one_process(tmp_path, capfd):
    """``generate --num-gpus 2 --ulysses-degree 2 --dit-quantization int8`` (two gloo ranks, each
    quantizing its own copy) writes the image the single-process INT8 run writes: activations are
    quantized per token, so sharding the tokens does not change the scales."""
    import imageio.v3 as iio

    from ditattn.cli import main

    common = [
        "generate",
        "--model-path",
        "ditattn:tiny-wan",
        "--prompt",
        "a red fox",
        "--num-frames",
        "1",
        "--height",
        "48",
        "--width",
        "48",
        "--num-inference-steps",
        "2",
        "--dit-quantization",
        "int8",
        "--output-path",
        str(tmp_path),
    ]
    assert main(common + ["--output-file", "one.png"]) == 0
    assert main(common + ["--output-file", "two.png", "--num-gpus", "2", "--ulysses-degree", "2"]) == 0
    out = capfd.readouterr().out
    assert out.count("DiT linears: int8 (16 of 26 linears)") == 2, out
    a, b = (iio.imread(tmp_path / f).astype(int) for f in ("one.png", "two.png"))
    assert a.std() > 1 and np.abs(a - b).max() <= 1


# ------------------------------------------------------------------------------------------------
# with LoRA and offload


def _write_lora(path, seed=0, rank=4):
    """A diffusers-format LoRA on two of the tiny DiT's quantized linears."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    out = {}
    for module in ("blocks.0.attn1.to_q", "blocks.1.ffn.net.2"):
        out[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, 512, generator=g) * 0.2
        out[f"transformer.{module}.lora_B.weight"] = torch.randn(512, rank, generator=g) * 0.2
    save_file(out, str(path))
    return str(path)


@needs_torchao
@pytest.mark.parametrize("fuse", [True, False])
def test_lora_with_int8_linears(tmp_path, fuse):
    """A fused LoRA goes into the weights before they are quantized; an unfused one runs beside the
    8-bit base GEMM (its per-request scale still switches it: scale 0 is the plain INT8 model)."""
    from ditattn.models.lora import LoRALinear
    from ditattn.pipelines.wan import WanPipelineNative

    path = _write_lora(tmp_path / "style.safetensors")
    kw = dict(device="cpu", dtype="float32", lora=[path], lora_fuse=fuse)
    lat = lambda p, **g: p.generate("a fox", output_type="latent", progress=False, **SMALL, **g).frames  # noqa: E731
    plain_q = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", device="cpu", dtype="float32", dit_quantization="int8"
    )
    ref = lat(WanPipelineNative.from_pretrained("ditattn:tiny-wan", **kw))
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", dit_quantization="int8", **kw)
    layer = pipe.components["transformer"].blocks[0].attn1.to_q
    assert isinstance(layer, LoRALinear) != fuse and not Q.plain_weight(layer)
    out = lat(pipe)
    assert 0 < ((out - ref).norm() / ref.norm()).item() < 2e-2
    assert ((out - lat(plain_q)).norm() / ref.norm()).item() > 3e-2  # the LoRA is applied
    if not fuse:
        assert torch.equal(lat(pipe, lora={"style": 0.0}), lat(plain_q))


@needs_torchao
def test_offload_with_quantization(capsys):
    """``--offload text_encoder`` keeps the DiT on its device: it composes; ``model`` / ``group``
    move plain CPU master tensors by their data, which quantized weights do not support: refused."""
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", device="cpu", dtype="float32", dit_quantization="int8", offload="text_encoder"
    )
    assert pipe.quantization_summary() == "int8 (16 of 26 linears)"
    assert torch.isfinite(pipe.generate("a fox", output_type="latent", progress=False, **SMALL).frames).all()
    for mode in ("model", "group"):
        err = _refused(capsys, ["generate", "--prompt", "x", "--dit-quantization", "int8", "--offload", mode])
        assert f"--dit-quantization int8 with --offload {mode}" in err and "--offload text_encoder" in err
