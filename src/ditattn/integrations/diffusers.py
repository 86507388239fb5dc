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

Families (:data:`FAMILIES`): Wan 2.1 / 2.2 (``WanTransformer3DModel``: self-attention over video
tokens, separate cross-attention) and Flux (``FluxTransformer2DModel``: joint attention, text tokens
first — ditattn moves them after the image tokens for sparse backends and back) get every backend,
sparse included.  HunyuanVideo and Qwen-Image pass a text-padding mask, so they get the backends
that take an additive mask (dense).  Any other transformer whose processors call
``dispatch_attention_fn`` gets the dense backends; a sparse backend there is refused (no latent
grid).  Not supported: diffusers context parallelism, attention dropout, processors with weights.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import types
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Union

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
from ditattn.attention.selector import check_overrides_used
from ditattn.attention.specs import SPECS
from ditattn.errors import AttentionConfigError
from ditattn.platforms import Platform, platform_for_device, use_platform
from ditattn.runconfig import AttentionOptions, RunConfig

DIT = ("transformer", "transformer_2")
Geometry = Callable[[nn.Module, tuple, dict], tuple[Optional[tuple[int, int, int]], int]]


# ------------------------------------------------------------------------------------------------
# families: what ditattn knows about a diffusers transformer class


def _arg(args: tuple, kwargs: dict, name: str, index: int):
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _video_grid(model: nn.Module, args: tuple, kwargs: dict):
    """Wan: latents ``[B, C, F, H, W]`` patchified by ``config.patch_size = (p_t, p_h, p_w)``;
    self-attention sees the video tokens only."""
    x = _arg(args, kwargs, "hidden_states", 0)
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None, 0
    pt, ph, pw = (int(p) for p in model.config.patch_size)
    return (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw), 0


def _flux_grid(model: nn.Module, args: tuple, kwargs: dict):
    """Flux: packed latents ``[B, H' * W', C]`` whose ``img_ids [H' * W', 3]`` hold ``(0, row,
    col)`` in row-major order, after ``encoder_hidden_states [B, L, D]`` text tokens (joint
    attention, text first).  A sequence that is not one such grid (reference images) has none."""
    x, ids = _arg(args, kwargs, "hidden_states", 0), kwargs.get("img_ids")
    text = _arg(args, kwargs, "encoder_hidden_states", 1)
    if not isinstance(x, torch.Tensor) or not isinstance(ids, torch.Tensor) or not isinstance(text, torch.Tensor):
        return None, 0
    ids = ids[0] if ids.dim() == 3 else ids
    rows, cols = ids[:, 1].long(), ids[:, 2].long()
    h, w = int(rows.max()) + 1, int(cols.max()) + 1
    n = torch.arange(ids.shape[0], device=ids.device)
    if h * w != x.shape[1] or not (torch.equal(rows, n // w) and torch.equal(cols, n % w)):
        return None, text.shape[1]
    return (1, h, w), text.shape[1]


@dataclasses.dataclass(frozen=True)
class Family:
    """How ditattn reads one family of diffusers transformers.

    classes: the transformer class names; geometry: ``(model, args, kwargs) -> (grid, text_len)``
    from the transformer's forward arguments (None: no grid, so no sparse backend); text_first:
    joint attention puts the text tokens before the video/image tokens (ditattn's sparse backends
    take them after); needs_bias: the processors pass an attention mask (only backends that take an
    additive mask qualify).
    """

    name: str
    classes: tuple[str, ...]
    geometry: Optional[Geometry] = None
    text_first: bool = False
    needs_bias: bool = False


FAMILIES = (
    Family("Wan 2.1 / 2.2", ("WanTransformer3DModel",), geometry=_video_grid),
    Family("Flux", ("FluxTransformer2DModel",), geometry=_flux_grid, text_first=True),
    Family("HunyuanVideo", ("HunyuanVideoTransformer3DModel",), needs_bias=True),
    Family("Qwen-Image", ("QwenImageTransformer2DModel",), needs_bias=True),
)
GENERIC = Family("other diffusers transformers", ())


def family_of(model: nn.Module) -> Family:
    name = type(model).__name__
    return next((f for f in FAMILIES if name in f.classes), GENERIC)


# ------------------------------------------------------------------------------------------------
# the dispatch function each routed processor calls


def _rotate(t: torch.Tensor, n: int) -> torch.Tensor:
    """Move the first ``n`` tokens of ``[B, S, H, D]`` to the end."""
    return torch.cat([t[:, n:], t[:, :n]], dim=1)


def _unrotate(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([t[:, -n:], t[:, :-n]], dim=1)


def _effective_backend(layer: LocalAttention):
    req = current_request()
    entry = req.override_table.get(id(layer)) if req is not None and req.override_table else None
    return entry[0] if entry is not None else layer.backend


def make_dispatch(layer: LocalAttention, family: Family) -> Callable[..., torch.Tensor]:
    """A drop-in for diffusers' ``dispatch_attention_fn`` that runs ``layer``.

    query ``[B, S_q, H, D]``, key / value ``[B, S_kv, H_kv, D]`` (diffusers' and ditattn's layout);
    attn_mask: a boolean or additive mask broadcastable to ``[B, H, S_q, S_kv]``.  Returns
    ``[B, S_q, H, D]``.  Raises :class:`AttentionConfigError` for what ditattn does not run here
    (dropout, context parallelism, a causal call on a non-causal layer, extra backend kwargs)."""
    where = f"{layer.component}.{layer.prefix}" if layer.component else layer.prefix

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if dropout_p:
            raise AttentionConfigError(f"{where}: attention dropout ({dropout_p}) is not run by ditattn backends "
                                       "(inference only); call remove(pipe) to train")
        if parallel_config is not None:
            raise AttentionConfigError(f"{where}: diffusers context parallelism is not supported with ditattn "
                                       "backends; disable it or call remove(pipe)")
        if bool(is_causal) != layer.causal:
            raise AttentionConfigError(f"{where}: a causal attention call reached a non-causal ditattn layer")
        if attention_kwargs:
            raise AttentionConfigError(f"{where}: backend-specific attention kwargs {sorted(attention_kwargs)} "
                                       "are diffusers' own; ditattn backends take --attention-backend-config")
        if scale is not None:
            layer.scale = float(scale)
        text_len = layer.text_len_hint()
        rotate = (family.text_first and layer.role == "self" and text_len and attn_mask is None
                  and SPECS[_effective_backend(layer)].sparse)
        if rotate:
            query, key, value = (_rotate(t, text_len) for t in (query, key, value))
        out = layer(query, key, value, attn_bias=attn_mask)
        return _unrotate(out, text_len) if rotate else out

    return dispatch_attention_fn


class RoutedLayer(LocalAttention):
    """A :class:`LocalAttention` serving one diffusers attention module."""

    def text_len_hint(self) -> int:
        return current_forward().text_len if self.role == "self" else 0


def _routed_processor(processor: Any, layer: RoutedLayer, family: Family, where: str) -> Any:
    """A processor of ``processor``'s class (same state, same ``__call__`` code, so same
    signature and ``isinstance``) whose ``dispatch_attention_fn`` is ``layer``."""
    cls = type(processor)
    if isinstance(processor, nn.Module):
        raise AttentionConfigError(f"{where}: its attention processor {cls.__name__} carries weights (an adapter); "
                                   "ditattn routes processors without weights only")
    fn = getattr(cls.__call__, "__func__", cls.__call__)
    code = getattr(fn, "__code__", None)
    if code is None or "dispatch_attention_fn" not in code.co_names:
        raise AttentionConfigError(
            f"{where}: its attention processor {cls.__name__} does not call diffusers' dispatch_attention_fn, so "
            "ditattn cannot route it (supported: processors of the attention-dispatch API, diffusers >= 0.35)")
    scope = dict(fn.__globals__)
    scope["dispatch_attention_fn"] = make_dispatch(layer, family)
    call = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    call.__kwdefaults__, call.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    call.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    routed_cls = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__, "__doc__": cls.__doc__,
                                             "_ditattn_layer": layer})
    routed = object.__new__(routed_cls)
    routed.__dict__.update(processor.__dict__)
    return routed


# ------------------------------------------------------------------------------------------------
# building the layers of one DiT component

_BLOCK = re.compile(r"\.(\d+)\.")


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if n and callable(getattr(m, "set_processor", None)) and getattr(m, "processor", None) is not None]


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
    """One DiT component under ditattn: its layers (an ``nn.ModuleList`` that is not part of the
    model), the original processors, the forward hooks and the attention scope (the plan)."""

    name: str
    model: nn.Module
    family: Family
    layers: nn.ModuleList
    originals: list
    scope: ComponentScope
    hooks: list = dataclasses.field(default_factory=list)


def _route_component(name: str, model: nn.Module, dtype: torch.dtype) -> RoutedComponent:
    """Build the layers of ``model`` under the caller's attention settings, in the component scope
    ``name``, and swap the processors (all or nothing)."""
    family = family_of(model)
    built = []
    with component_scope(name, selectable=True) as scope:
        for prefix, mod in _attention_modules(model):
            heads, head_dim, kv = _shape(mod)
            role = "cross" if getattr(mod, "is_cross_attention", False) else "self"
            m = _BLOCK.search(f".{prefix}.")
            layer = RoutedLayer(heads, head_dim, kv, role=role, prefix=prefix, layer_idx=int(m.group(1)) if m else None,
                                needs_bias=family.needs_bias, dtype=dtype)
            built.append((mod, layer, _routed_processor(mod.processor, layer, family, f"{name}.{prefix}")))
    if not built:
        raise AttentionConfigError(f"{name} ({type(model).__name__}) has no diffusers attention module to route")
    if family.geometry is None:
        sparse = sorted({l.backend.value for _, l, _ in built if SPECS[l.backend].sparse})
        if sparse:
            raise AttentionConfigError(
                f"{name} ({type(model).__name__}): sparse backend {', '.join(sparse)} needs the latent grid, which "
                f"ditattn reads for {', '.join(f.name for f in FAMILIES if f.geometry)} only; choose a dense backend")
    originals = [(mod, mod.processor) for mod, _, _ in built]
    for mod, _, routed in built:
        mod.processor = routed  # set_processor would log about dropping module processors
    return RoutedComponent(name, model, family, nn.ModuleList([l for _, l, _ in built]), originals, scope)


# ------------------------------------------------------------------------------------------------
# per-call state: grid, step, request override


_call_state: contextvars.ContextVar[Optional[RequestState]] = contextvars.ContextVar("ditattn_diffusers_call",
                                                                                     default=None)


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
        t = _arg(args, kwargs, "timestep", 1)
    if isinstance(t, torch.Tensor) and t.numel():
        t = t.flatten()[0]
    if t is not None:
        hit = torch.nonzero(torch.isclose(ts.float().cpu(), torch.as_tensor(float(t)), rtol=1e-5, atol=1e-4))
        if hit.numel():
            return int(hit[0, 0]), ts.numel()
    idx = getattr(sched, "step_index", None)
    return (int(idx) if isinstance(idx, int) else None), ts.numel()


@dataclasses.dataclass
class Applied:
    """What :func:`apply` did to one pipeline: ``components`` (name -> :class:`RoutedComponent`),
    ``settings``, ``platform``, the default request state of every call (``default_state``:
    apply's ``attention_backend_override`` / ``skip_softmax``), and ``last_state``: the request
    state of the latest call (its ``stats``, e.g. skip-softmax tile fractions)."""

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

    def _state_for_call(self, pipe) -> Optional[RequestState]:
        state = _call_state.get()
        if state is not None:
            return state
        if self.default_state is None:
            return None
        ts = getattr(getattr(pipe, "scheduler", None), "timesteps", None)
        if self.last_state is None or ts is not self._timesteps_seen:  # a new pipeline call: fresh statistics
            self._timesteps_seen = ts
            self.last_state = dataclasses.replace(self.default_state, stats={})
        return self.last_state

    def _hook(self, comp: RoutedComponent, pipe_ref):
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


def _options(attention_backend=None, attention_backend_config=None, component_attention_backends=None,
             enable_attention_backend_autotune=False) -> AttentionSettings:
    """The :class:`AttentionSettings` of apply's arguments, checked like the CLI's flags."""
    cfg = RunConfig(attention=AttentionOptions(attention_backend=attention_backend,
                                               attention_backend_config=attention_backend_config,
                                               component_attention_backends=component_attention_backends,
                                               enable_attention_backend_autotune=enable_attention_backend_autotune))
    return cfg.attention_settings()


def _components(pipe) -> tuple[dict[str, nn.Module], tuple, tuple]:
    """``(dits, fixed, known)`` of a diffusers pipeline (see :func:`route_models`)."""
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, Mapping):
        raise AttentionConfigError(f"apply() takes a diffusers pipeline (with .components); got {type(pipe).__name__}")
    dits = {n: m for n, m in comps.items() if n in DIT and isinstance(m, nn.Module)}
    fixed = tuple(n for n, m in comps.items() if n not in dits and isinstance(m, nn.Module))
    return dits, fixed, tuple(comps)


def route_models(dits: Mapping[str, nn.Module], settings: AttentionSettings, *, fixed: tuple = (),
                 known: tuple = (), platform: Optional[Platform] = None, pipe=None,
                 dtype: Optional[torch.dtype] = None) -> Applied:
    """Route the DiT components ``dits`` (``transformer`` / ``transformer_2`` -> model) under
    ``settings`` on ``platform`` (None: the platform of the transformer's device); ``fixed``: the
    pipeline's other models (reported as fixed attention), ``known``: all its component names.
    ``pipe``: the pipeline whose scheduler gives the denoising step (None: a plan, no hooks);
    ``dtype``: the compute dtype the layers are chosen for (None: the transformer's).
    Validates the component overrides and backend config keys as the native pipeline does, all
    or nothing."""
    if not dits:
        raise AttentionConfigError(f"this pipeline has no transformer component to route (components: "
                                   f"{', '.join(sorted(known)) or 'none'})")
    for key in settings.component_overrides:
        comp = key.split(".")[0]
        if comp in fixed:
            raise AttentionConfigError(
                f"--component-attention-backends: '{key}': in a diffusers pipeline ditattn selects the attention of "
                f"the transformer(s) only; {comp} keeps its library's own attention")
    first = next(iter(next(iter(dits.values())).parameters()), None)
    if platform is None:
        platform = platform_for_device(first.device if first is not None and first.device.type != "meta" else "cpu")
    if dtype is None:
        dtype = first.dtype if first is not None else torch.get_default_dtype()
    routed: dict[str, RoutedComponent] = {}
    try:
        with use_platform(platform), attention_settings(settings):
            for name, model in dits.items():
                routed[name] = _route_component(name, model, dtype)
            scopes = {n: c.scope for n, c in routed.items()}
            check_overrides_used(settings.component_overrides, scopes, list(known) or list(dits))
            check_config_keys_used(settings.config, [d.backend for s in scopes.values() for d in s.decisions])
    except BaseException:
        for comp in routed.values():
            _restore(comp)
        raise
    applied = Applied(routed, list(fixed), settings, platform, dtype)
    if pipe is not None:
        try:
            ref = weakref.ref(pipe)
        except TypeError:  # an object without weak references (a stand-in for a pipeline)
            ref = lambda: pipe  # noqa: E731
        for comp in routed.values():
            pre, post = applied._hook(comp, ref)
            comp.hooks = [comp.model.register_forward_pre_hook(pre, with_kwargs=True),
                          comp.model.register_forward_hook(post, with_kwargs=True, always_call=True)]
    return applied


def _restore(comp: RoutedComponent) -> None:
    for mod, proc in comp.originals:
        mod.processor = proc
    for h in comp.hooks:
        h.remove()
    comp.hooks = []


# ------------------------------------------------------------------------------------------------
# the public functions


def applied(pipe) -> Optional[Applied]:
    """The :class:`Applied` record of ``pipe`` (None when ditattn is not applied)."""
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
) -> Applied:
    """Put ditattn's attention selection into the diffusers pipeline ``pipe`` (in place) and return
    the :class:`Applied` record.  Call it after moving the pipeline to its device and dtype.

    attention_backend: ditattn's global backend (``"fa"``, ``"torch_sdpa"``, ``"video_sparse_attn"``,
    an ``AttentionBackendEnum``; None: the platform's automatic choice); attention_backend_config:
    backend parameters (dict, JSON, ``k=v`` pairs or a file path); component_attention_backends:
    ``{"transformer": ..., "transformer.cross": ..., "transformer_2": ...}`` or the CLI's spec;
    attention_backend_override / skip_softmax (``{"threshold_scale_factor": x, "start_step": n}``):
    request-scoped settings for every call (one call: :func:`options`); enable_attention_backend_autotune:
    measured choice for automatically chosen layers.  Applying again replaces the previous
    selection.  Raises :class:`AttentionConfigError` (nothing changed) for anything the CLI refuses.
    """
    settings = _options(attention_backend, attention_backend_config, component_attention_backends,
                        enable_attention_backend_autotune)
    dits, fixed, known = _components(pipe)
    previous = applied(pipe)
    if previous is not None:
        remove(pipe)
    try:
        result = route_models(dits, settings, fixed=fixed, known=known, pipe=pipe)
    except BaseException:
        if previous is not None:  # leave the pipeline as it was
            _reinstall(pipe, previous)
        raise
    if attention_backend_override not in (None, "") or skip_softmax is not None:
        try:
            result.default_state = prepare_request(result, attention_backend_override, skip_softmax)
        except BaseException:
            for comp in result.components.values():
                _restore(comp)
            if previous is not None:
                _reinstall(pipe, previous)
            raise
    pipe.__dict__["_ditattn"] = result
    return result


def _reinstall(pipe, previous: Applied) -> None:
    dits, fixed, known = _components(pipe)
    again = route_models(dits, previous.settings, fixed=fixed, known=known, pipe=pipe)
    again.default_state = previous.default_state and prepare_request(again, previous.default_state.override,
                                                              previous.default_state.skip_softmax)
    pipe.__dict__["_ditattn"] = again


def remove(pipe) -> None:
    """Give ``pipe`` its original attention processors back and drop ditattn's hooks (a no-op when
    ditattn is not applied)."""
    record = pipe.__dict__.pop("_ditattn", None) if hasattr(pipe, "__dict__") else None
    if record is not None:
        for comp in record.components.values():
            _restore(comp)


def _require(pipe) -> Applied:
    record = applied(pipe)
    if record is None:
        raise AttentionConfigError("ditattn is not applied to this pipeline; call "
                                   "ditattn.integrations.diffusers.apply(pipe, ...) first")
    return record


def prepare_request(record: Applied, override, skip_softmax) -> RequestState:
    """The validated request state of ``override`` / ``skip_softmax`` on ``record``'s DiT layers."""
    from ditattn.attention.override import prepare_request_override

    if override is not None and not isinstance(override, str):
        override = getattr(override, "value", override)
    with use_platform(record.platform):
        return prepare_request_override(record.dit_modules, override, record.settings, skip_softmax=skip_softmax,
                                        dtype=record.dtype)


@contextlib.contextmanager
def options(pipe, *, attention_backend_override: Any = None,
            skip_softmax: Optional[Mapping[str, Any]] = None) -> Iterator[RequestState]:
    """Request-scoped attention for the pipeline calls inside the block: a dense drop-in backend for
    the DiT (``fa``, ``torch_sdpa``, ``sage_attn``, ``sage_attn_3``) and/or skip softmax.  Validated
    against every DiT layer first (refused with the reason, nothing switched); yields the request
    state, whose ``stats`` collect what the backends report."""
    record = _require(pipe)
    state = prepare_request(record, attention_backend_override, skip_softmax)
    token = _call_state.set(state)
    try:
        yield state
    finally:
        _call_state.reset(token)


def call_backends(pipe, state: Optional[RequestState] = None) -> list[str]:
    """The backends the DiT layers run under ``state`` (None: the latest call's, or the default)."""
    from ditattn.attention.override import request_backends

    record = _require(pipe)
    layers = [l for c in record.components.values() for l in c.layers]
    ordered = [l for l in layers if l.role == "self"] + [l for l in layers if l.role == "cross"]
    return request_backends(ordered, state if state is not None else record.last_state or record.default_state)


def plan_of(record: Applied) -> dict:
    """The attention plan of a routed pipeline (``ditattn plan --json``'s object)."""
    comps = [{"name": n, "selectable": True, "layers": [d.to_json() for d in c.scope.decisions]}
             for n, c in record.components.items()]
    comps += [{"name": n, "selectable": False, "layers": []} for n in record.fixed]
    return {"platform": record.platform.to_json(), "components": comps}


def plan(pipe) -> dict:
    """Which ditattn backend each attention layer of ``pipe``'s transformer(s) got and why (the
    object ``ditattn plan --json`` prints); text encoders and VAEs are listed as fixed."""
    return plan_of(_require(pipe))


__all__ = ["FAMILIES", "Applied", "Family", "applied", "apply", "call_backends", "options", "plan", "remove"]
