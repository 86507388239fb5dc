"""The attention backend selector.

Priority, first that applies: explicit ``backend=`` argument > global force > the layer's required
backend > component override (role key beats component key) > CLI ``--attention-backend`` > the
layer's declared default > automatic choice.  Every decision records where it came from and, for
each rejected candidate, why (:class:`Decision`).

Strictness: the DiT (and explicit, forced, required or component choices) fail closed with the
reasons; auxiliary components fall back from the CLI global to their default or a platform
backend, recorded in the plan; a sparse backend chosen for self-attention serves cross-attention
through a compatible dense backend; upstream's (SGLang) platform substitutions (``fa`` without a runtime →
``torch_sdpa``, …) are allowed and recorded.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional

import torch

from ditattn.attention.backends.base import NoKernelError, get_impl
from ditattn.attention.config import component_override_for
from ditattn.attention.context import (
    AttentionSettings,
    ComponentScope,
    current_component,
    current_settings,
    get_forced_backend,
)
from ditattn.attention.names import CROSS_ROLES
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import SPECS, LayerRequest
from ditattn.errors import AttentionConfigError, BackendUnavailableError, short_repr
from ditattn.platforms import Platform, current_platform
from ditattn.platforms.policy import auto_candidates, runtime_fallback, substitute

log = logging.getLogger("ditattn.attention")

SOURCES = ("forced", "explicit", "component_role", "component", "cli", "layer_default", "required", "auto", "autotune")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What an attention layer declares about itself.

    prefix: module path inside its component (``blocks.0.attn1``); role: ``self``|``cross``|``cross_image``;
    default_backend: the layer's/component's declared default; required_backend: needed for
    correctness (kept even under overrides); supported_backends: hints for automatic choice only.
    """

    prefix: str = ""
    role: str = "self"
    head_dim: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    dtype: Optional[torch.dtype] = None
    causal: bool = False
    needs_bias: bool = False
    needs_lse: bool = False
    varlen: bool = False
    default_backend: Optional[B] = None
    required_backend: Optional[B] = None
    supported_backends: Optional[tuple[B, ...]] = None

    def request(self) -> LayerRequest:
        return LayerRequest(
            role=self.role,
            head_dim=self.head_dim,
            dtype=self.dtype,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            causal=self.causal,
            needs_bias=self.needs_bias,
            needs_lse=self.needs_lse,
            varlen=self.varlen,
        )


@dataclasses.dataclass
class Decision:
    """The outcome of selection for one layer (one row of the plan)."""

    prefix: str
    role: str
    backend: B
    source: str
    requested: Optional[B] = None
    fallback_reason: Optional[str] = None
    rejected: list = dataclasses.field(default_factory=list)  # [(backend name, [reasons])]
    runtime: str = ""
    override_key: Optional[str] = None
    # per-call fallback of an automatic choice (SM100: cuDNN first, FA when cuDNN has no kernel)
    runtime_fallback: Optional[B] = None
    runtime_fallback_used: bool = False  # set once a call actually ran the fallback

    def to_json(self) -> dict:
        d = {
            "prefix": self.prefix,
            "role": self.role,
            "backend": self.backend.value,
            "source": self.source,
            "fallback_reason": self.fallback_reason,
        }
        if self.requested is not None and self.requested != self.backend:
            d["requested"] = self.requested.value
        if self.runtime:
            d["runtime"] = self.runtime
        if self.runtime_fallback is not None:
            d["runtime_fallback"] = self.runtime_fallback.value
        return d

    def ran_backends(self) -> list[B]:
        """The backends calls of this layer have run: its backend, plus the per-call fallback once used."""
        return [self.backend] + ([self.runtime_fallback] if self.runtime_fallback_used else [])


# sources where a user (or the model, for ``required``) named the backend: a substitution is a WARNING
EXPLICIT_SOURCES = ("explicit", "forced", "required", "component_role", "component", "cli")


def resolve_on_platform(backend: B, req: LayerRequest, platform: Platform, allow_substitute: bool = True):
    """How ``platform`` serves ``backend`` for ``req``: ``(backend_to_run, substitution_reason,
    reasons)``; reasons empty when usable (possibly through a platform substitution).

    Substitutions chain (``sage_attn`` -> ``fa`` -> ``torch_sdpa`` on Hopper without a fixed
    sageattention and without FlashAttention); the reason names every hop."""
    reasons = SPECS[backend].reasons(req, platform)
    if not reasons:
        return backend, None, []
    if allow_substitute and (backend is B.FP8_FA_SM120 or not SPECS[backend].semantic_reasons(req)):
        sub = substitute(backend, req, platform)
        if sub is not None:
            target, why = sub
            run, why2, reasons2 = (
                resolve_on_platform(target, req, platform) if target != backend else (target, None, reasons)
            )
            if not reasons2:
                return run, (f"{why}; then {target.value} -> {run.value}: {why2}" if why2 else why), []
    return backend, None, reasons


def _note(component: Optional[ComponentScope], where: str, msg: str, source: str) -> None:
    """Log a substitution: WARNING when the backend was asked for explicitly, else INFO; once per
    component, role and message (a DiT has dozens of identical layers)."""
    level = logging.WARNING if source in EXPLICIT_SOURCES else logging.INFO
    if component is not None:
        key = (where.split(" ", 1)[-1], msg)
        if key in component.logged:
            return
        component.logged.add(key)
        where = f"{component.name} {where.split(' ', 1)[-1]}"
    log.log(level, "%s: %s", where, msg)


def _auto(req: LayerRequest, platform: Platform, hints: Optional[Iterable[B]], rejected: list):
    cands = auto_candidates(req, platform)
    if hints:
        hinted = [b for b in cands if b in set(hints)]
        cands = hinted + [b for b in cands if b not in hinted]
    for b in cands:
        reasons = SPECS[b].reasons(req, platform)
        if not reasons:
            return b
        rejected.append((b.value, reasons))
    raise AttentionConfigError(
        f"no attention backend can serve this layer on {platform.describe()}: "
        + "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected)
    )


def _dense_for_cross(layer: LayerSpec, req, platform, settings, rejected) -> tuple[B, str]:
    """A compatible dense backend for cross-attention when self-attention runs sparse."""
    for b, why in ((settings.backend, "cli"), (layer.default_backend, "layer_default")):
        if b is not None and not SPECS[b].sparse:
            run, _, reasons = resolve_on_platform(b, req, platform)
            if not reasons:
                return run, why
    return _auto(req, platform, layer.supported_backends, rejected), "auto"


def select_backend(
    layer: LayerSpec,
    *,
    explicit: Optional[B] = None,
    component: Optional[ComponentScope] = None,
    settings: Optional[AttentionSettings] = None,
    platform: Optional[Platform] = None,
) -> Decision:
    """Resolve the backend of one attention layer; raises :class:`AttentionConfigError` when an
    explicit, forced, required, component or (DiT) CLI choice cannot serve it."""
    component = component if component is not None else current_component()
    settings = settings if settings is not None else current_settings()
    platform = platform if platform is not None else current_platform()
    req = layer.request()
    if settings.ring_degree > 1 and layer.role == "self":
        req = dataclasses.replace(req, needs_lse=True)
    comp_name = component.name if component else None
    is_dit = component.is_dit if component else True
    where = f"{comp_name + '.' if comp_name else ''}{layer.prefix or 'layer'} ({layer.role}-attention)"
    rejected: list = []

    # --- who asked for what, in priority order
    asked: Optional[B] = None
    source = "auto"
    strict = False
    override_key = None
    forced = get_forced_backend()
    if explicit is not None:
        asked, source, strict = explicit, "explicit", True
    elif forced is not None:
        asked, source, strict = forced, "forced", True
    elif layer.required_backend is not None:
        asked, source, strict = layer.required_backend, "required", True
    else:
        ov = component_override_for(settings.component_overrides, comp_name, layer.role) if comp_name else None
        if ov is not None:
            asked, override_key, source = ov[0], ov[1], ov[2]
            strict = True
        elif settings.backend is not None:
            asked, source, strict = settings.backend, "cli", is_dit
        elif layer.default_backend is not None:
            asked, source, strict = layer.default_backend, "layer_default", False

    if component is not None and override_key is not None:
        component.used_override_keys.add(override_key)

    if asked is None:
        b = _auto(req, platform, layer.supported_backends, rejected)
        return Decision(
            layer.prefix,
            layer.role,
            b,
            "auto",
            rejected=rejected,
            runtime=_runtime_label(b, platform, req, settings.config),
            runtime_fallback=runtime_fallback(b, req, platform),
        )

    run, sub_reason, reasons = resolve_on_platform(asked, req, platform)
    if not reasons and run is B.SAGE_ATTN:
        _check_sage_impl(platform, settings.config)
    if not reasons:
        if sub_reason:
            _note(component, where, f"{asked.value} requested, running {run.value}: {sub_reason}", source)
        return Decision(
            layer.prefix,
            layer.role,
            run,
            source,
            requested=asked,
            fallback_reason=(f"{asked.value} -> {run.value}: {sub_reason}" if sub_reason else None),
            runtime=_runtime_label(run, platform, req, settings.config),
            override_key=override_key,
        )
    rejected.append((asked.value, reasons))

    # a sparse backend reaching a cross-attention layer (text or image; the global or component key,
    # or a `.cross` role key) -> a compatible dense backend, the one exception to strictness
    if (
        SPECS[asked].sparse
        and layer.role in CROSS_ROLES
        and source in ("forced", "component", "component_role", "cli")
    ):
        b, how = _dense_for_cross(layer, req, platform, settings, rejected)
        why = (
            f"{asked.value} is a sparse self-attention backend and cannot serve cross-attention; "
            f"using {b.value} ({how})"
        )
        _note(component, where, why, source)
        return Decision(
            layer.prefix,
            layer.role,
            b,
            source,
            requested=asked,
            fallback_reason=why,
            rejected=rejected,
            runtime=_runtime_label(b, platform, req, settings.config),
            override_key=override_key,
        )

    if strict:
        raise BackendUnavailableError(asked.value, reasons, what=where)

    # auxiliary component (CLI global) or a declared default that does not fit: fall back
    if source == "cli" and layer.default_backend is not None and layer.default_backend != asked:
        run2, sub2, reasons2 = resolve_on_platform(layer.default_backend, req, platform)
        if not reasons2:
            why = f"{asked.value} cannot serve this layer ({'; '.join(reasons)}); using the layer default {run2.value}"
            _note(component, where, why, "layer_default")  # an auxiliary component falls back to its default: INFO
            return Decision(
                layer.prefix,
                layer.role,
                run2,
                "layer_default",
                requested=asked,
                fallback_reason=why,
                rejected=rejected,
                runtime=_runtime_label(run2, platform, req, settings.config),
            )
        rejected.append((layer.default_backend.value, reasons2))
    b = _auto(req, platform, layer.supported_backends, rejected)
    why = f"{asked.value} cannot serve this layer ({'; '.join(reasons)}); using the platform choice {b.value}"
    _note(component, where, why, "auto")
    return Decision(
        layer.prefix,
        layer.role,
        b,
        "auto",
        requested=asked,
        fallback_reason=why,
        rejected=rejected,
        runtime=_runtime_label(b, platform, req, settings.config),
    )


_fallback_logged: set = set()


def bind_impl(decision: Decision):
    """The implementation a layer with ``decision`` calls: the backend's, wrapped with the per-call
    fallback when the decision has one (a call the backend has no kernel for runs the fallback,
    logged once per reason at WARNING and recorded on the decision)."""
    impl = get_impl(decision.backend)
    fallback = decision.runtime_fallback
    if fallback is None:
        return impl
    fb_impl = get_impl(fallback)

    def run(q, k, v, call, config):
        try:
            return impl(q, k, v, call, config)
        except NoKernelError as exc:
            decision.runtime_fallback_used = True
            msg = f"{decision.backend.value} -> {fallback.value} for this call: {'; '.join(exc.reasons)}"
            if msg not in _fallback_logged:
                _fallback_logged.add(msg)
                log.warning("%s (automatic choice; per-call fallback)", msg)
            return fb_impl(q, k, v, call, {})

    return run


def _check_sage_impl(platform: Platform, config: Optional[dict]) -> None:
    """Refuse ``sage_attn`` with ``impl=package`` up front where the installed package cannot run
    (Hopper with a sageattention release that lacks the SM90 binding fix): its first call would fail."""
    if (config or {}).get("impl") != "package":
        return
    spec = SPECS[B.SAGE_ATTN]
    for rt in spec.runtimes.get(platform.name, ()):
        why = spec.broken_reason(rt, platform)
        if why:
            raise AttentionConfigError(
                f"sage_attn: impl package cannot run here: {why}; use impl auto (the in-tree kernels)"
            )


def _runtime_label(b: B, platform: Platform, req: Optional[LayerRequest] = None, config: Optional[dict] = None) -> str:
    """The runtime label of ``b`` in the plan: the backend's own rule when its row has one (``sage_attn``
    names the implementation that runs for ``req`` under the backend config), else the first
    installed runtime of ``platform``."""
    spec = SPECS[b]
    if spec.runtime_label is not None:
        return spec.runtime_label(spec, platform, req, config)
    rt = spec.runtime_on(platform)
    return rt.label if rt is not None else ""


def check_overrides_used(overrides: dict, scopes: dict[str, ComponentScope], known_components: Iterable[str]) -> None:
    """After all components are built: every override key must name a component of the model,
    target selectable attention, and have been used by at least one layer."""
    known = set(known_components)
    for key in overrides:
        comp = key.split(".")[0]
        if comp not in known:
            raise AttentionConfigError(
                f"--component-attention-backends: unknown component {short_repr(comp)}; this model's components: "
                f"{', '.join(sorted(known))}"
            )
        scope = scopes.get(comp)
        if scope is None or not scope.selectable:
            raise AttentionConfigError(
                f"--component-attention-backends: component '{comp}' has fixed attention (it builds no "
                f"selectable attention layers), so '{key}' cannot apply; remove it"
            )
        used = any(key in s.used_override_keys for s in scopes.values())
        if not used:
            role = key.partition(".")[2]
            what = {
                "": "no attention layer",
                "cross_image": "no image cross-attention layer (not an image-to-video checkpoint with image_dim)",
            }.get(role, f"no {role}-attention layer")
            raise AttentionConfigError(
                f"--component-attention-backends: override '{key}' was not used: component '{comp}' has "
                f"{what} that takes it"
            )
