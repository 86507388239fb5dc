"""ditattn's attention selection inside an existing diffusers pipeline.

::

    from diffusers import WanPipeline
    from ditattn.integrations import diffusers as ditattn_diffusers

    pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", dtype=torch.bfloat16).to("cuda")
    ditattn_diffusers.apply(pipe, attention_backend="video_sparse_attn", attention_backend_config={"sparsity": 0.9},
                            component_attention_backends={"transformer.cross": "fa"})
    video = pipe("a red fox running through fresh snow").frames
    print(ditattn_diffusers.plan(pipe))          # which backend each attention layer got, and why
    with ditattn_diffusers.options(pipe, attention_backend_override="torch_sdpa"):
        video = pipe("...").frames               # this call only (a dense drop-in; not on a sparse DiT)
    ditattn_diffusers.remove(pipe)               # diffusers' own attention again

How it works.  diffusers' attention modules compute Q/K/V in their processor and hand them, in
ditattn's ``[batch, seq, heads, head_dim]`` layout, to ``dispatch_attention_fn``.  :func:`apply`
builds one :class:`~ditattn.attention.layer.LocalAttention` per attention module of each DiT
component (``transformer``, ``transformer_2``) inside that component's attention scope — so the
global backend, component / role overrides, backend config, autotune and the platform rules
resolve exactly as in the native pipeline, and fail the same way — and gives the module a
processor of the same class whose ``dispatch_attention_fn`` is that layer.  A forward hook on each
DiT sets what sparse backends read per call: the latent grid ``(T, H, W)`` after patching, the text
tokens of joint attention, and the denoising step (from the pipeline's scheduler).  Text encoders
(transformers models) and VAEs keep their own attention: overrides for them are refused.

Modules: :mod:`.families` (what ditattn knows per transformer class), :mod:`.routing` (layers,
processors, hooks).  Families (:data:`~.families.FAMILIES`): Wan 2.1 / 2.2 (``WanTransformer3DModel``: self-attention
over video
tokens, separate cross-attention) and Flux (``FluxTransformer2DModel``: joint attention, text tokens
first — ditattn moves them after the image tokens for sparse backends and back) get every backend,
sparse included.  HunyuanVideo and Qwen-Image pass a text-padding mask, so they get the backends
that take an additive mask (dense).  Any other transformer whose processors call
``dispatch_attention_fn`` gets the dense backends; a sparse backend there is refused (no latent
grid).  Not supported: diffusers context parallelism, attention dropout, processors with weights.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Union

from torch import nn

from ditattn.attention.context import AttentionSettings, RequestState
from ditattn.errors import AttentionConfigError
from ditattn.integrations.diffusers.families import FAMILIES, GENERIC, Family, family_of
from ditattn.integrations.diffusers.routing import DIT, Routing, call_state, make_dispatch, route_models
from ditattn.platforms import use_platform
from ditattn.runconfig import AttentionOptions, RunConfig


def _settings(
    attention_backend=None,
    attention_backend_config=None,
    component_attention_backends=None,
    enable_attention_backend_autotune=False,
) -> AttentionSettings:
    """The :class:`AttentionSettings` of apply's arguments, checked like the CLI's flags."""
    cfg = RunConfig(
        attention=AttentionOptions(
            attention_backend=attention_backend,
            attention_backend_config=attention_backend_config,
            component_attention_backends=component_attention_backends,
            enable_attention_backend_autotune=enable_attention_backend_autotune,
        )
    )
    return cfg.attention_settings()


def _components(pipe) -> tuple[dict[str, nn.Module], tuple, tuple]:
    """``(dits, fixed, known)`` of a diffusers pipeline (see :func:`~.routing.route_models`)."""
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, Mapping):
        raise AttentionConfigError(f"apply() takes a diffusers pipeline (with .components); got {type(pipe).__name__}")
    dits = {n: m for n, m in comps.items() if n in DIT and isinstance(m, nn.Module)}
    fixed = tuple(n for n, m in comps.items() if n not in dits and isinstance(m, nn.Module))
    return dits, fixed, tuple(n for n, m in comps.items() if m is not None)


def applied(pipe) -> Optional[Routing]:
    """The :class:`~.routing.Routing` that :func:`apply` installed in ``pipe`` (None: not applied)."""
    return getattr(pipe, "__dict__", {}).get("_ditattn")


def apply(
    pipe,
    *,
    attention_backend: Any = None,
    attention_backend_config: Union[str, Mapping[str, Any], None] = None,
    component_attention_backends: Union[str, Mapping[str, Any], None] = None,
    attention_backend_override: Any = None,
    skip_softmax: Optional[Mapping[str, Any]] = None,
    enable_attention_backend_autotune: bool = False,
) -> Routing:
    """Put ditattn's attention selection into the diffusers pipeline ``pipe`` (in place) and return
    its :class:`~.routing.Routing`.  Call it after moving the pipeline to its device and dtype.

    attention_backend: ditattn's global backend (``"fa"``, ``"torch_sdpa"``, ``"video_sparse_attn"``,
    an ``AttentionBackendEnum``; None: the platform's automatic choice); attention_backend_config:
    backend parameters (dict, JSON, ``k=v`` pairs or a file path); component_attention_backends:
    ``{"transformer": ..., "transformer.cross": ..., "transformer_2": ...}`` or the CLI's spec;
    attention_backend_override / skip_softmax (``{"threshold_scale_factor": x, "start_step": n}``):
    request-scoped settings of every call (one call: :func:`options`); enable_attention_backend_autotune:
    measured choice for the automatically chosen layers.  Applying again replaces the previous
    selection.  Raises :class:`AttentionConfigError` for anything the CLI refuses, and then
    changes nothing.
    """
    settings = _settings(
        attention_backend, attention_backend_config, component_attention_backends, enable_attention_backend_autotune
    )
    dits, fixed, known = _components(pipe)
    routing = route_models(dits, settings, fixed=fixed, known=known)
    if attention_backend_override not in (None, "") or skip_softmax is not None:
        routing.default_state = prepare_request(routing, attention_backend_override, skip_softmax)
    remove(pipe)
    routing.install(pipe)
    pipe.__dict__["_ditattn"] = routing
    return routing


def remove(pipe) -> None:
    """Give ``pipe`` its original attention processors back and drop ditattn's hooks (a no-op when
    ditattn is not applied)."""
    routing = pipe.__dict__.pop("_ditattn", None) if hasattr(pipe, "__dict__") else None
    if routing is not None:
        routing.uninstall()


def _require(pipe) -> Routing:
    routing = applied(pipe)
    if routing is None:
        raise AttentionConfigError(
            "ditattn is not applied to this pipeline; call ditattn.integrations.diffusers.apply(pipe, ...) first"
        )
    return routing


def prepare_request(routing: Routing, override: Any, skip_softmax: Optional[Mapping[str, Any]]) -> RequestState:
    """The request state of ``override`` (a dense drop-in backend) / ``skip_softmax`` validated
    against every DiT layer of ``routing`` (:class:`AttentionConfigError` with the reason)."""
    from ditattn.attention.override import prepare_request_override

    override = getattr(override, "value", override)  # an AttentionBackendEnum member
    with use_platform(routing.platform):
        return prepare_request_override(
            routing.dit_modules, override, routing.settings, skip_softmax=skip_softmax, dtype=routing.dtype
        )


@contextlib.contextmanager
def options(
    pipe, *, attention_backend_override: Any = None, skip_softmax: Optional[Mapping[str, Any]] = None
) -> Iterator[RequestState]:
    """Request-scoped attention for the pipeline calls inside the block: a dense drop-in backend for
    the DiT (``fa``, ``torch_sdpa``, ``sage_attn``, ``sage_attn_3``) and/or skip softmax.  Validated
    against every DiT layer first (refused with the reason, nothing switched); yields the request
    state, whose ``stats`` collect what the backends report."""
    state = prepare_request(_require(pipe), attention_backend_override, skip_softmax)
    token = call_state.set(state)
    try:
        yield state
    finally:
        call_state.reset(token)


def call_backends(pipe, state: Optional[RequestState] = None) -> list[str]:
    """The backends the DiT layers run under ``state`` (None: the latest call's, else the default)."""
    from ditattn.attention.override import request_backends

    routing = _require(pipe)
    return request_backends(
        routing.layers(), state if state is not None else routing.last_state or routing.default_state
    )


def plan(pipe) -> dict:
    """Which ditattn backend each attention layer of ``pipe``'s transformer(s) got and why (the
    object ``ditattn plan --json`` prints); text encoders and VAEs are listed as fixed."""
    return _require(pipe).plan()


__all__ = [
    "FAMILIES",
    "GENERIC",
    "Family",
    "Routing",
    "applied",
    "apply",
    "call_backends",
    "family_of",
    "make_dispatch",
    "options",
    "plan",
    "prepare_request",
    "remove",
    "route_models",
]
