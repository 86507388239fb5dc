"""8-bit linear layers for the Wan DiT through torchao (``--dit-quantization none|fp8|int8``).

Modes (:data:`MODES`):

* ``fp8``: torchao ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` — weights
  e4m3 with one scale per output channel, quantized once when the model is loaded; activations
  e4m3 with one scale per token, computed on every call; the GEMM is ``torch._scaled_mm`` with
  bfloat16 output.  Needs an NVIDIA GPU of compute capability >= 8.9 and ``--dtype bfloat16``.
  The activations of the selected plain linears are quantized by :mod:`ditattn.models.fp8_linear`
  (one fused pass per distinct input, torchao's numerics) with torchao's weights and the same
  ``torch._scaled_mm``; any other (an unfused LoRA adapter) keeps torchao's own path, and the plan
  (:meth:`QuantizationPlan.activations`, the load-time log line) lists it.
* ``int8``: torchao ``Int8DynamicActivationInt8WeightConfig()`` — per-channel int8 weights,
  per-token int8 activations (symmetric), ``torch._int_mm`` on CUDA; also runs on CPU.  Slow on
  H100/H200-class GPUs (a Wan2.1-1.3B 480p step: 1,671 ms against 448 ms with bf16 linears on the
  H200, docs/quantization.md): use ``fp8`` there.
* ``none``: the linears stay in the compute dtype.

Which linears are quantized is a declared rule (:data:`WAN_LINEAR_RULES`, first match wins, plus
the size limits of :class:`LinearQuantRule`): the per-token GEMMs of every block (self-attention
q/k/v/out, cross-attention q/out, both feed-forward GEMMs) are quantized; the time embedding
(one row per sample, float32 like diffusers), the text embedding and the cross-attention K/V (run
once per generation on the text and cached), the final projection (the prediction itself, 64
output channels) and any GEMM narrower than ``min_features`` stay in the compute dtype.
:func:`plan_linears` applies the rule without touching weights (it runs on meta-device models, for
``ditattn plan``); :func:`quantize_linears` applies it with torchao's ``quantize_``.

Only torchao's Python code is used: FP8 goes through ``torch._scaled_mm`` and INT8 through
``torch._int_mm`` (both PyTorch ops), so torchao's C++ extensions — which torchao skips when its
build does not match the installed torch — are not needed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Iterable, Optional

import torch
from torch import nn

from ditattn.errors import AttentionConfigError

log = logging.getLogger("ditattn.quantization")

MODES = ("none", "fp8", "int8")
#: lowest compute capability with FP8 tensor cores (Ada SM89, Hopper SM90, Blackwell SM100/120)
FP8_MIN_SM = 89
#: where torchao's INT8 GEMM runs (torch._int_mm on NVIDIA GPUs, PyTorch's CPU kernels)
INT8_PLATFORMS = ("cpu", "cuda")
INSTALL_HINT = "pip install 'ditattn[quant]'"

# (module name pattern (fnmatch), quantize?, why) — first match wins; a linear no pattern names stays
WAN_LINEAR_RULES: tuple[tuple[str, bool, str], ...] = (
    ("condition_embedder.time_embedder.*", False, "time embedding (one row per sample, float32)"),
    ("condition_embedder.time_proj", False, "time embedding (one row per sample, float32)"),
    ("condition_embedder.text_embedder.*", False, "text embedding (once per generation)"),
    ("condition_embedder.image_embedder.*", False, "image embedding (once per generation)"),
    ("blocks.*.attn2.to_[kv]", False, "cross-attention K/V of the text (once per generation, cached)"),
    ("blocks.*.attn2.add_[kv]_proj", False, "cross-attention K/V of the image (once per generation)"),
    ("proj_out", False, "final projection (the prediction itself)"),
    ("blocks.*.attn1.to_[qkv]", True, "self-attention projection"),
    ("blocks.*.attn1.to_out.0", True, "self-attention projection"),
    ("blocks.*.attn2.to_q", True, "cross-attention query / output projection"),
    ("blocks.*.attn2.to_out.0", True, "cross-attention query / output projection"),
    ("blocks.*.ffn.net.0.proj", True, "feed-forward"),
    ("blocks.*.ffn.net.2", True, "feed-forward"),
)
UNNAMED = "not named by the rule"


@dataclasses.dataclass(frozen=True)
class LinearQuantRule:
    """Which linears of a DiT are quantized.

    patterns: ``(fnmatch pattern of the module name, quantize?, reason)``, first match wins;
    min_features: a linear with fewer input or output features stays (its activation quantization
    pass costs more than the 8-bit GEMM saves); multiple: input and output features must be
    multiples of it (the 8-bit GEMMs' tile constraint, 16 for ``torch._scaled_mm``).
    """

    patterns: tuple[tuple[str, bool, str], ...] = WAN_LINEAR_RULES
    min_features: int = 512
    multiple: int = 16

    def decide(self, name: str, linear: nn.Linear) -> "LinearDecision":
        k, n = linear.in_features, linear.out_features
        quantize, reason = False, UNNAMED
        for pattern, q, why in self.patterns:
            if fnmatch.fnmatchcase(name, pattern):
                quantize, reason = q, why
                break
        if quantize and min(k, n) < self.min_features:
            quantize, reason = False, f"small GEMM (fewer than {self.min_features} features)"
        elif quantize and (k % self.multiple or n % self.multiple):
            quantize, reason = False, f"features not a multiple of {self.multiple}"
        return LinearDecision(name, k, n, quantize, reason)


DEFAULT_RULE = LinearQuantRule()


@dataclasses.dataclass(frozen=True)
class LinearDecision:
    """One ``nn.Linear`` of the model: ``[out_features, in_features]`` weight, quantized or kept, why."""

    name: str
    in_features: int
    out_features: int
    quantize: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class QuantizationPlan:
    """The rule's result for one model: every linear, quantized or kept, in module order."""

    mode: str
    decisions: tuple[LinearDecision, ...]
    #: fp8: the quantized linears whose activations go through torchao's own quantization instead of
    #: the fused quantizer of :mod:`ditattn.models.fp8_linear`, ``(name, reason)`` (empty: none)
    torchao_activations: tuple[tuple[str, str], ...] = ()

    @property
    def quantized(self) -> list[str]:
        return [d.name for d in self.decisions if d.quantize] if self.mode != "none" else []

    def groups(self) -> list[tuple[bool, str, list[str]]]:
        """``(quantized, reason, [module names])`` per reason, quantized groups first."""
        out: dict[tuple[bool, str], list[str]] = {}
        for d in self.decisions:
            out.setdefault((d.quantize and self.mode != "none", d.reason), []).append(d.name)
        return [(q, r, names) for (q, r), names in sorted(out.items(), key=lambda kv: not kv[0][0])]

    def activations(self) -> Optional[str]:
        """fp8: how the activations are quantized (``fused per-row quantizer for 240 of 240 linears``
        plus the torchao fallbacks by reason), else None."""
        if self.mode != "fp8" or not self.quantized:
            return None
        n = len(self.quantized)
        line = f"fused per-row quantizer for {n - len(self.torchao_activations)} of {n} linears"
        if self.torchao_activations:
            why: dict[str, int] = {}
            for _, r in self.torchao_activations:
                why[r] = why.get(r, 0) + 1
            line += "; torchao's own path for " + ", ".join(f"{c} ({r})" for r, c in why.items())
        return line

    def to_json(self) -> dict:
        """``{"mode", "quantized": N, "total": N, "groups": [{"quantized", "reason", "count", "layers"}]}``
        (fp8 adds ``"activations": {"summary", "torchao": [{"layer", "reason"}]}``)."""
        out = {
            "mode": self.mode,
            "quantized": len(self.quantized),
            "total": len(self.decisions),
            "groups": [
                {"quantized": q, "reason": r, "count": len(names), "layers": names} for q, r, names in self.groups()
            ],
        }
        if self.activations() is not None:
            out["activations"] = {
                "summary": self.activations(),
                "torchao": [{"layer": n, "reason": r} for n, r in self.torchao_activations],
            }
        return out

    def describe(self) -> str:
        """One line: ``fp8: 240 of 306 linears quantized (...); kept in the compute dtype: 3 time
        embedding (...), ...``."""
        if self.mode == "none":
            return f"none: {len(self.decisions)} linears in the compute dtype"
        got = [f"{len(n)} {r}" for q, r, n in self.groups() if q]
        kept = [f"{len(n)} {r}" for q, r, n in self.groups() if not q]
        line = f"{self.mode}: {len(self.quantized)} of {len(self.decisions)} linears quantized"
        if got:
            line += f" ({', '.join(got)})"
        line += f"; kept in the compute dtype: {', '.join(kept)}" if kept else ""
        return line + (f"; activations: {self.activations()}" if self.activations() else "")


def check_something_quantized(plans: list[QuantizationPlan]) -> None:
    """Refuse a quantization mode under which the rule selects no linear of any DiT (a model whose
    GEMMs are all narrower than ``min_features``, e.g. the small built-in models): the run would be
    exactly the unquantized one, so saying nothing would report bf16 figures as 8-bit ones.  Raises
    :class:`AttentionConfigError` naming the mode and what the rule kept; ``none`` and empty lists pass."""
    if not plans or plans[0].mode == "none" or any(p.quantized for p in plans):
        return
    kept = sorted({f"{r}" for p in plans for _, r, _ in p.groups()})
    total = sum(len(p.decisions) for p in plans)
    raise AttentionConfigError(
        f"--dit-quantization {plans[0].mode}: the rule selects none of this model's {total} linears "
        f"(kept: {'; '.join(kept)}), so the run would not be quantized at all; use --dit-quantization none "
        f"(the rule quantizes per-token GEMMs with at least {DEFAULT_RULE.min_features} input and output "
        "features: docs/quantization.md)"
    )


def summary(plans: Iterable[QuantizationPlan]) -> Optional[str]:
    """``"fp8 (240 of 306 linears)"`` (Wan2.1-1.3B) for the plans of a quantized DiT (several DiTs:
    summed), else None."""
    plans = list(plans)
    if not plans or plans[0].mode == "none":
        return None
    n, total = sum(len(p.quantized) for p in plans), sum(len(p.decisions) for p in plans)
    return f"{plans[0].mode} ({n} of {total} linears)"


def check_mode(mode: object) -> str:
    """``mode`` as one of :data:`MODES` (None means ``none``); AttentionConfigError otherwise."""
    if mode is None:
        return "none"
    if mode not in MODES:
        raise AttentionConfigError(f"unknown DiT quantization {mode!r}; accepted: {', '.join(MODES)}")
    return str(mode)


def why_not(mode: str, platform, dtype: torch.dtype) -> Optional[str]:
    """Why ``mode`` cannot run on ``platform`` (a :class:`~ditattn.platforms.Platform`, real or
    simulated) in compute ``dtype`` — every missing piece in one line — or None when it can."""
    mode = check_mode(mode)
    if mode == "none":
        return None
    missing = []
    if not platform.has_package("torchao"):
        missing.append(f"torchao (not installed: {INSTALL_HINT})")
    if mode == "fp8":
        if platform.name != "cuda" or (platform.sm or 0) < FP8_MIN_SM:
            missing.append(
                f"an NVIDIA GPU with compute capability >= {FP8_MIN_SM // 10}.{FP8_MIN_SM % 10} "
                f"(FP8 tensor cores; this run is on {platform.describe()})"
            )
        if dtype != torch.bfloat16:
            missing.append(
                f"--dtype bfloat16 (row-wise scaled FP8 GEMMs write bfloat16; this run is "
                f"{str(dtype).replace('torch.', '')})"
            )
    elif platform.name not in INT8_PLATFORMS:
        missing.append(f"a CPU or an NVIDIA GPU (torchao's INT8 GEMM; this run is on {platform.describe()})")
    if not missing:
        return None
    return f"--dit-quantization {mode} needs " + " and ".join(missing)


def check_supported(mode: str, platform, dtype: torch.dtype) -> None:
    """Raise :class:`AttentionConfigError` with :func:`why_not`'s reason when ``mode`` cannot run."""
    reason = why_not(mode, platform, dtype)
    if reason:
        raise AttentionConfigError(reason)


def linears(model: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` with its module name, in module order."""
    return ((name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear))


def plan_linears(model: nn.Module, mode: str, rule: LinearQuantRule = DEFAULT_RULE) -> QuantizationPlan:
    """The rule applied to every linear of ``model`` (weights untouched; works on the meta device).
    fp8: a selected linear that is not a plain ``nn.Linear`` (an unfused LoRA adapter) is listed as
    quantizing its activations through torchao's own path."""
    plan = QuantizationPlan(check_mode(mode), tuple(rule.decide(name, m) for name, m in linears(model)))
    if plan.mode != "fp8":
        return plan
    other = tuple(
        (n, f"{type(model.get_submodule(n)).__name__} runs its own forward")
        for n in plan.quantized
        if type(model.get_submodule(n)) is not nn.Linear
    )
    return dataclasses.replace(plan, torchao_activations=other)


def plain_weight(linear: nn.Linear) -> bool:
    """True when ``linear.weight`` is a plain dense tensor (not a torchao quantized tensor): what
    code that reads the weight itself — the cuBLASLt GELU epilogue — needs; a quantized linear
    runs through its module (torchao's 8-bit GEMM)."""
    return type(linear.weight) in (torch.Tensor, nn.Parameter)


def _torchao_quantization():
    """``torchao.quantization``, imported without torchao's import-time warning about skipping its
    C++ extensions (those are not used here: see the module docstring)."""
    ao_log = logging.getLogger("torchao")
    level = ao_log.level
    ao_log.setLevel(logging.ERROR)
    try:
        import torchao.quantization as q
    except ImportError as exc:
        raise AttentionConfigError(
            f"--dit-quantization needs torchao, which cannot be imported ({exc}); {INSTALL_HINT}"
        ) from None
    finally:
        ao_log.setLevel(level)
    return q


def torchao_config(mode: str):
    """The torchao ``quantize_`` config of ``mode`` (``fp8`` or ``int8``).  torchao's inductor
    settings (``set_inductor_config``) are left alone: they would change ``torch.compile`` globally,
    for every model of the process."""
    q = _torchao_quantization()
    try:
        if mode == "fp8":
            return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow(), set_inductor_config=False)
        if mode == "int8":
            return q.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    except (AttributeError, TypeError) as exc:  # a torchao older than the floor
        raise AttentionConfigError(
            f"--dit-quantization {mode}: this torchao lacks what it needs ({exc}); "
            "install torchao>=0.16 (pip install 'ditattn[quant]')"
        ) from None
    raise AttentionConfigError(f"no torchao config for DiT quantization {mode!r}; accepted: fp8, int8")


def quantize_linears(model: nn.Module, mode: str, rule: LinearQuantRule = DEFAULT_RULE) -> QuantizationPlan:
    """Quantize, in place, the linears of ``model`` that ``rule`` selects (weights quantized once,
    now; activations on every call) and return the plan.  ``mode="none"`` changes nothing.  The
    caller validates the platform first (:func:`check_supported`)."""
    plan = plan_linears(model, mode, rule)
    chosen = set(plan.quantized)
    if not chosen:
        return plan
    q = _torchao_quantization()
    q.quantize_(model, torchao_config(plan.mode), filter_fn=lambda module, fqn: fqn in chosen)
    left = [n for n in plan.quantized if plain_weight(model.get_submodule(n))]
    if left:  # torchao skipped a layer it was asked to quantize: say so rather than report it quantized
        raise AttentionConfigError(f"torchao did not quantize {len(left)} selected linear(s), e.g. {left[0]}")
    if plan.mode == "fp8":  # the fused activation quantizer where it applies; torchao's path elsewhere, listed
        from ditattn.models.fp8_linear import mark_fused

        other = tuple((n, r) for n in plan.quantized if (r := mark_fused(model.get_submodule(n))) is not None)
        plan = dataclasses.replace(plan, torchao_activations=other)
    log.info("DiT linears %s", plan.describe())
    return plan
