"""Routing diffusers attention modules through ditattn layers.

:func:`route_models` builds one :class:`RoutedLayer` (a
:class:`~ditattn.attention.layer.LocalAttention`) per attention module of each DiT component inside
the component's attention scope, and a processor of the module's processor class whose
``dispatch_attention_fn`` is that layer (:func:`make_dispatch`), without touching the model;
:meth:`Routing.install` swaps the processors in and adds the forward hooks that set the latent
grid, text tokens, denoising step and request state of each transformer call;
:meth:`Routing.uninstall` undoes both.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import types
import weakref
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ditattn.attention.config import check_config_keys_used
from ditattn.attention.context import (
    AttentionSettings,
    ComponentScope,
    RequestState,
    attention_settings,
    component_scope,
    current_forward,
    current_request,
    forward_context,
    request_scope,
)
from ditattn.attention.layer import LocalAttention
from ditattn.attention.names import DIT_COMPONENTS
from ditattn.attention.selector import check_overrides_used
from ditattn.attention.specs import SPECS
from ditattn.errors import AttentionConfigError
from ditattn.integrations.diffusers.families import FAMILIES, Family, family_of, forward_arg
from ditattn.platforms import Platform, platform_for_device, use_platform

DIT = DIT_COMPONENTS

# the request state of the pipeline calls inside ``options(pipe, ...)``
call_state: contextvars.ContextVar[Optional[RequestState]] = contextvars.ContextVar(
    "ditattn_diffusers_call", default=None
)


def _rotate(t: torch.Tensor, n: int) -> torch.Tensor:
    """Move the first ``n`` tokens of ``[B, S, H, D]`` to the end."""
    return torch.cat([t[:, n:], t[:, :n]], dim=1)


def _unrotate(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([t[:, -n:], t[:, :-n]], dim=1)


def _effective_backend(layer: LocalAttention):
    req = current_request()
    entry = req.override_table.get(id(layer)) if req is not None and req.override_table else None
    return entry[0] if entry is not None else layer.backend


def make_dispatch(layer: "RoutedLayer", family: Family) -> Callable[..., torch.Tensor]:
    """A drop-in for diffusers' ``dispatch_attention_fn`` that runs ``layer``.

    query ``[B, S_q, H, D]``, key / value ``[B, S_kv, H_kv, D]`` (diffusers' and ditattn's layout);
    attn_mask: a boolean or additive mask broadcastable to ``[B, H, S_q, S_kv]``.  Returns
    ``[B, S_q, H, D]``.  Raises :class:`AttentionConfigError` for what ditattn does not run here
    (dropout, context parallelism, a causal call on a non-causal layer, extra backend kwargs)."""
    where = f"{layer.component}.{layer.prefix}" if layer.component else layer.prefix
    platform = layer.platform

    def dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        attention_kwargs=None,
        *,
        backend=None,
        parallel_config=None,
    ):
        if dropout_p:
            raise AttentionConfigError(
                f"{where}: attention dropout ({dropout_p}) is not run by ditattn backends "
                "(inference only); call remove(pipe) to train"
            )
        if parallel_config is not None:
            raise AttentionConfigError(
                f"{where}: diffusers context parallelism is not supported with ditattn "
                "backends; disable it or call remove(pipe)"
            )
        if bool(is_causal) != layer.causal:
            raise AttentionConfigError(f"{where}: a causal attention call reached a non-causal ditattn layer")
        if attention_kwargs:
            raise AttentionConfigError(
                f"{where}: backend-specific attention kwargs {sorted(attention_kwargs)} "
                "are diffusers' own; ditattn backends take --attention-backend-config"
            )
        if query.device.type != platform.device_type and not platform.simulated:
            raise AttentionConfigError(
                f"{where}: the backends were chosen for {platform.device_type} but the "
                f"pipeline now runs on {query.device.type}; call apply(pipe, ...) again after "
                "pipe.to(...)"
            )
        if scale is not None:
            layer.scale = float(scale)
        text_len = layer.text_len_hint()
        rotate = (
            family.text_first
            and layer.role == "self"
            and text_len
            and attn_mask is None
            and SPECS[_effective_backend(layer)].sparse
        )
        if rotate:
            query, key, value = (_rotate(t, text_len) for t in (query, key, value))
        out = layer(query, key, value, attn_bias=attn_mask)
        return _unrotate(out, text_len) if rotate else out

    return dispatch_attention_fn


class RoutedLayer(LocalAttention):
    """A :class:`LocalAttention` serving one diffusers attention module."""

    @property
    def platform(self):
        """The platform the backend was chosen for (the device the pipeline was on at ``apply``)."""
        return self._platform

    def text_len_hint(self) -> int:
        return current_forward().text_len if self.role == "self" else 0


def _routed_processor(processor: Any, layer: RoutedLayer, family: Family, where: str) -> Any:
    """A processor of ``processor``'s class (same state, same ``__call__`` code, so same
    signature and ``isinstance``) whose ``dispatch_attention_fn`` is ``layer``."""
    cls = type(processor)
    if isinstance(processor, nn.Module):
        raise AttentionConfigError(
            f"{where}: its attention processor {cls.__name__} carries weights (an adapter); "
            "ditattn routes processors without weights only"
        )
    fn = getattr(cls.__call__, "__func__", cls.__call__)
    code = getattr(fn, "__code__", None)
    if code is None or "dispatch_attention_fn" not in code.co_names:
        raise AttentionConfigError(
            f"{where}: its attention processor {cls.__name__} does not call diffusers' dispatch_attention_fn, so "
            "ditattn cannot route it (supported: processors of the attention-dispatch API, diffusers >= 0.35)"
        )
    scope = dict(fn.__globals__)
    scope["dispatch_attention_fn"] = make_dispatch(layer, family)
    call = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    call.__kwdefaults__, call.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    call.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    routed_cls = type(
        cls.__name__,
        (cls,),
        {
            "__call__": call,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
            "_ditattn_layer": layer,
            "_ditattn_original": processor,
        },
    )
    routed = object.__new__(routed_cls)
    routed.__dict__.update(processor.__dict__)
    return routed


_BLOCK = re.compile(r"\.(\d+)\.")


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (n, m)
        for n, m in model.named_modules()
        if n and callable(getattr(m, "set_processor", None)) and getattr(m, "processor", None) is not None
    ]


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the attention projections of ``model`` (diffusers keeps some modules float32)."""
    for _, mod in _attention_modules(model):
        weight = getattr(getattr(mod, "to_q", None), "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight.dtype
    return torch.get_default_dtype()


def _shape(mod: nn.Module) -> tuple[int, int, int]:
    """(heads, head_dim, kv_heads) of a diffusers attention module."""
    heads = int(mod.heads)
    inner = getattr(mod, "inner_dim", None) or mod.to_q.out_features
    head_dim = int(inner) // heads
    to_k = getattr(mod, "to_k", None)
    kv = to_k.out_features // head_dim if isinstance(to_k, nn.Linear) else heads
    return heads, head_dim, int(kv)


@dataclasses.dataclass
class RoutedComponent:
    """One DiT component routed through ditattn: its layers (an ``nn.ModuleList`` that is not part
    of the model), ``processors`` — ``(module, original processor, routed processor)`` — the
    forward hooks while installed, and the attention scope (the plan)."""

    name: str
    model: nn.Module
    family: Family
    layers: nn.ModuleList
    processors: list
    scope: ComponentScope
    hooks: list = dataclasses.field(default_factory=list)


def _route_component(name: str, model: nn.Module, dtype: torch.dtype) -> RoutedComponent:
    """Build the layers and routed processors of ``model`` under the caller's attention settings,
    in the component scope ``name`` (the model is not changed)."""
    family = family_of(model)
    built = []
    with component_scope(name, selectable=True) as scope:
        for prefix, mod in _attention_modules(model):
            heads, head_dim, kv = _shape(mod)
            role = "cross" if getattr(mod, "is_cross_attention", False) else "self"
            m = _BLOCK.search(f".{prefix}.")
            layer = RoutedLayer(
                heads,
                head_dim,
                kv,
                role=role,
                prefix=prefix,
                layer_idx=int(m.group(1)) if m else None,
                needs_bias=family.needs_bias,
                dtype=dtype,
            )
            original = getattr(mod.processor, "_ditattn_original", mod.processor)  # routed before: its original
            built.append((mod, original, _routed_processor(original, layer, family, f"{name}.{prefix}")))
    if not built:
        raise AttentionConfigError(f"{name} ({type(model).__name__}) has no diffusers attention module to route")
    layers = nn.ModuleList([p._ditattn_layer for _, _, p in built])
    if family.geometry is None:
        sparse = sorted({l.backend.value for l in layers if SPECS[l.backend].sparse})
        if sparse:
            raise AttentionConfigError(
                f"{name} ({type(model).__name__}): sparse backend {', '.join(sparse)} needs the latent grid, which "
                f"ditattn reads for {', '.join(f.name for f in FAMILIES if f.geometry)} only; choose a dense backend"
            )
    return RoutedComponent(name, model, family, layers, built, scope)


def _step(pipe, args: tuple, kwargs: dict) -> tuple[Optional[int], Optional[int]]:
    """``(step index, number of steps)`` of this transformer call, from the pipeline's scheduler:
    the pipeline's current timestep (or the call's) located in ``scheduler.timesteps``, else the
    scheduler's ``step_index``."""
    sched = getattr(pipe, "scheduler", None) if pipe is not None else None
    ts = getattr(sched, "timesteps", None)
    if not isinstance(ts, torch.Tensor) or ts.numel() == 0:
        return None, None
    t = getattr(pipe, "_current_timestep", None)
    if t is None:
        t = forward_arg(args, kwargs, "timestep", 1)
    if isinstance(t, torch.Tensor) and t.numel():
        t = t.flatten()[0]
    if t is not None:
        hit = torch.nonzero(torch.isclose(ts.float().cpu(), torch.as_tensor(float(t)), rtol=1e-5, atol=1e-4))
        if hit.numel():
            return int(hit[0, 0]), ts.numel()
    idx = getattr(sched, "step_index", None)
    return (int(idx) if isinstance(idx, int) else None), ts.numel()


@dataclasses.dataclass
class Routing:
    """ditattn's attention in one pipeline's transformer(s): ``components`` (name ->
    :class:`RoutedComponent`), ``fixed`` (the other models, which keep their attention),
    ``settings``, ``platform``, ``dtype``; ``default_state``: the request state of every call
    (apply's ``attention_backend_override`` / ``skip_softmax``); ``last_state``: the state of the
    latest call, whose ``stats`` hold what the backends reported (skip-softmax tile fractions)."""

    components: dict[str, RoutedComponent]
    fixed: list[str]
    settings: AttentionSettings
    platform: Platform
    dtype: torch.dtype
    default_state: Optional[RequestState] = None
    last_state: Optional[RequestState] = None
    _timesteps_seen: Any = None

    @property
    def dit_modules(self) -> list[nn.Module]:
        return [c.layers for c in self.components.values()]

    def layers(self) -> list[RoutedLayer]:
        """Every routed layer, self-attention first (the order backends are reported in)."""
        all_layers = [l for c in self.components.values() for l in c.layers]
        return [l for l in all_layers if l.role == "self"] + [l for l in all_layers if l.role == "cross"]

    def install(self, pipe=None) -> None:
        """Swap the routed processors in; with ``pipe`` (whose scheduler gives the step), add the
        forward hooks that set each transformer call's grid, step and request state."""
        ref = None
        if pipe is not None:
            try:
                ref = weakref.ref(pipe)
            except TypeError:  # an object without weak references (a stand-in for a pipeline)
                ref = lambda: pipe  # noqa: E731
        for comp in self.components.values():
            for mod, _, routed in comp.processors:
                mod.processor = routed  # (set_processor would log about dropping module processors)
            if ref is not None:
                pre, post = self._hooks(comp, ref)
                comp.hooks = [
                    comp.model.register_forward_pre_hook(pre, with_kwargs=True),
                    comp.model.register_forward_hook(post, with_kwargs=True, always_call=True),
                ]

    def uninstall(self) -> None:
        """The original processors back, the hooks removed."""
        for comp in self.components.values():
            for mod, original, _ in comp.processors:
                mod.processor = original
            for h in comp.hooks:
                h.remove()
            comp.hooks = []

    def _state_for_call(self, pipe) -> Optional[RequestState]:
        state = call_state.get()
        if state is not None or self.default_state is None:
            return state
        ts = getattr(getattr(pipe, "scheduler", None), "timesteps", None)
        if self.last_state is None or ts is not self._timesteps_seen:  # a new pipeline call: fresh statistics
            self._timesteps_seen = ts
            self.last_state = dataclasses.replace(self.default_state, stats={})
        return self.last_state

    def _hooks(self, comp: RoutedComponent, pipe_ref):
        def pre(module, args, kwargs):
            pipe = pipe_ref()
            grid, text_len = comp.family.geometry(module, args, kwargs) if comp.family.geometry else (None, 0)
            step, num_steps = _step(pipe, args, kwargs)
            stack = contextlib.ExitStack()
            stack.enter_context(forward_context(step=step, num_steps=num_steps, video_shape=grid, text_len=text_len))
            if current_request() is None:
                state = self._state_for_call(pipe)
                if state is not None:
                    stack.enter_context(request_scope(state))
            module.__dict__.setdefault("_ditattn_stacks", []).append(stack)

        def post(module, args, kwargs, output):
            stacks = module.__dict__.get("_ditattn_stacks")
            if stacks:
                stacks.pop().close()

        return pre, post

    def plan(self) -> dict:
        """The attention plan (``ditattn plan --json``'s object)."""
        comps = [
            {"name": n, "selectable": True, "layers": [d.to_json() for d in c.scope.decisions]}
            for n, c in self.components.items()
        ]
        comps += [{"name": n, "selectable": False, "layers": []} for n in self.fixed]
        return {"platform": self.platform.to_json(), "components": comps}


def route_models(
    dits: Mapping[str, nn.Module],
    settings: AttentionSettings,
    *,
    fixed: tuple = (),
    known: tuple = (),
    platform: Optional[Platform] = None,
    dtype: Optional[torch.dtype] = None,
) -> Routing:
    """The :class:`Routing` of the DiT components ``dits`` (``transformer`` / ``transformer_2`` ->
    model) under ``settings`` on ``platform`` (None: the platform of the transformer's device), for
    compute ``dtype`` (None: the attention projections'); ``fixed``: the pipeline's other models,
    ``known``: all its component names.  Validates the component overrides and backend config keys
    as the native pipeline does; nothing is installed (see :meth:`Routing.install`)."""
    if not dits:
        raise AttentionConfigError(
            f"this pipeline has no transformer component to route (components: {', '.join(sorted(known)) or 'none'})"
        )
    for key in settings.component_overrides:
        comp = key.split(".")[0]
        if comp in fixed:
            raise AttentionConfigError(
                f"--component-attention-backends: '{key}': in a diffusers pipeline ditattn selects the attention of "
                f"the transformer(s) only; {comp} keeps its library's own attention"
            )
    model = next(iter(dits.values()))
    first = next(iter(model.parameters()), None)
    if platform is None:
        platform = platform_for_device(first.device if first is not None and first.device.type != "meta" else "cpu")
    if dtype is None:  # the attention's compute dtype (norms and embedders may be kept in float32)
        dtype = _compute_dtype(model)
    with use_platform(platform), attention_settings(settings):
        routed = {name: _route_component(name, m, dtype) for name, m in dits.items()}
        scopes = {n: c.scope for n, c in routed.items()}
        check_overrides_used(settings.component_overrides, scopes, list(known) or list(dits))
        check_config_keys_used(settings.config, [d.backend for s in scopes.values() for d in s.decisions])
    return Routing(routed, list(fixed), settings, platform, dtype)
