"""Attention state: the global force, the run's settings, the component being built, and the
request/step state of the forward pass.

The force is process-wide (like a debugger switch).  Everything request-scoped — the per-request
backend override, skip-softmax parameters, the denoising step and the latent grid — lives in
context variables, so concurrent requests (threads or asyncio tasks) cannot leak into each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Optional

from ditattn.attention.names import DIT_COMPONENTS, AttentionBackendEnum

# ------------------------------------------------------------------------------------------------
# 1. global force

_forced: list[Optional[AttentionBackendEnum]] = [None]


def global_force_attn_backend(name: "str | AttentionBackendEnum | None") -> None:
    """Force every attention layer built (and every automatic ``attention()`` call) from now on to
    use ``name``; ``None`` clears the force. Highest selection priority after an explicit ``backend=``."""
    _forced[0] = None if name is None else AttentionBackendEnum.from_name(name)


def get_forced_backend() -> Optional[AttentionBackendEnum]:
    return _forced[0]


@contextlib.contextmanager
def global_force_attn_backend_context_manager(name: "str | AttentionBackendEnum | None") -> Iterator[None]:
    """Force ``name`` inside the block and restore the previous force on exit."""
    prev = _forced[0]
    global_force_attn_backend(name)
    try:
        yield
    finally:
        _forced[0] = prev


# ------------------------------------------------------------------------------------------------
# 2. run settings (the CLI / server arguments that drive selection)


@dataclasses.dataclass
class AttentionSettings:
    """What the user asked for: the CLI global backend, component overrides, backend config,
    autotune, and the sequence-parallel ring degree (ring needs LSE-capable backends)."""

    backend: Optional[AttentionBackendEnum] = None
    component_overrides: dict = dataclasses.field(default_factory=dict)  # key -> backend
    config: dict = dataclasses.field(default_factory=dict)  # raw --attention-backend-config
    autotune: bool = False
    ring_degree: int = 1
    ulysses_degree: int = 1
    compiled: bool = False  # torch.compile in use
    cuda_graphs: bool = False  # captured CUDA graphs in use

    def named_backends(self) -> list[AttentionBackendEnum]:
        """The backends these settings name for layers, each once: the global backend, then the
        component overrides' (the backends ``config`` configures; a request override runs with
        its defaults)."""
        named = ([self.backend] if self.backend is not None else []) + list(self.component_overrides.values())
        return list(dict.fromkeys(named))


_settings: contextvars.ContextVar[AttentionSettings] = contextvars.ContextVar(
    "ditattn_attention_settings",
    default=AttentionSettings(),  # noqa: B039 (settings are replaced, never changed in place)
)


def current_settings() -> AttentionSettings:
    return _settings.get()


@contextlib.contextmanager
def attention_settings(settings: AttentionSettings) -> Iterator[AttentionSettings]:
    token = _settings.set(settings)
    try:
        yield settings
    finally:
        _settings.reset(token)


# ------------------------------------------------------------------------------------------------
# 3. the component being constructed


@dataclasses.dataclass
class ComponentScope:
    """One pipeline component under construction; layers built inside record their decisions here.

    is_dit: the DiT (strict global backend); selectable: False for fixed-attention components.
    """

    name: str
    is_dit: bool = False
    selectable: bool = True
    decisions: list = dataclasses.field(default_factory=list)
    used_override_keys: set = dataclasses.field(default_factory=set)
    logged: set = dataclasses.field(default_factory=set)  # substitution messages already logged


_component: contextvars.ContextVar[Optional[ComponentScope]] = contextvars.ContextVar(
    "ditattn_component", default=None
)


def current_component() -> Optional[ComponentScope]:
    return _component.get()


@contextlib.contextmanager
def component_scope(name: str, *, is_dit: "bool | None" = None, selectable: bool = True) -> Iterator[ComponentScope]:
    """Construct a component inside this block so its layers see its overrides and record decisions."""
    if is_dit is None:
        is_dit = name.split(".")[0] in DIT_COMPONENTS
    scope = ComponentScope(name, is_dit=is_dit, selectable=selectable)
    token = _component.set(scope)
    try:
        yield scope
    finally:
        _component.reset(token)


# ------------------------------------------------------------------------------------------------
# 4. request and forward state


@dataclasses.dataclass(frozen=True)
class SkipSoftmaxParams:
    threshold_scale_factor: float
    start_step: int = 0


@dataclasses.dataclass
class RequestState:
    """Request-scoped attention state: the prepared override (layer -> impl table) and skip softmax."""

    override: Optional[AttentionBackendEnum] = None
    override_table: Optional[dict] = None  # id(layer) -> (backend, impl)
    skip_softmax: Optional[SkipSoftmaxParams] = None
    stats: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Per-forward metadata for backends: step index, total steps, latent grid after patching,
    text tokens appended to the video sequence."""

    step: Optional[int] = None
    num_steps: Optional[int] = None
    video_shape: Optional[tuple[int, int, int]] = None
    text_len: int = 0
    #: which classifier-free-guidance half this forward computes when the halves run as separate
    #: forwards ("cond" / "uncond"); None when one forward carries the whole batch (both halves batched)
    branch: Optional[str] = None


_request: contextvars.ContextVar[Optional[RequestState]] = contextvars.ContextVar("ditattn_request", default=None)
_forward: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar(
    "ditattn_forward",
    default=ForwardContext(),  # noqa: B039 (a frozen dataclass)
)


def current_request() -> Optional[RequestState]:
    return _request.get()


def current_forward() -> ForwardContext:
    return _forward.get()


@contextlib.contextmanager
def request_scope(state: RequestState) -> Iterator[RequestState]:
    token = _request.set(state)
    try:
        yield state
    finally:
        _request.reset(token)


@contextlib.contextmanager
def forward_context(**kw: Any) -> Iterator[ForwardContext]:
    """Set step / num_steps / video_shape / text_len / branch for the attention calls inside the block
    (fields not given keep their outer value)."""
    outer = _forward.get()
    ctx = dataclasses.replace(outer, **kw)
    token = _forward.set(ctx)
    try:
        yield ctx
    finally:
        _forward.reset(token)
