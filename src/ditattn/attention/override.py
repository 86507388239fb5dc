"""Request-scoped attention: the per-request backend override and skip softmax.

Both are validated against the whole DiT before anything switches, then installed as a table
``id(layer) -> (backend, impl, config)`` in a :class:`RequestState` that the caller activates with
``request_scope(state)`` around the denoise loop.  Layers consult the table per call; the server
default is untouched, so the next request without an override runs the default.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional

from torch import nn

from ditattn.attention.backends.base import AttnCall, get_impl
from ditattn.attention.config import validate_backend_config
from ditattn.attention.context import AttentionSettings, RequestState, SkipSoftmaxParams
from ditattn.attention.layer import LocalAttention
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.selector import resolve_on_platform
from ditattn.attention.specs import SPECS
from ditattn.errors import AttentionConfigError
from ditattn.platforms import current_platform
from ditattn.platforms.policy import substitute

log = logging.getLogger("ditattn.attention")

DROP_IN = tuple(b for b in B if SPECS[b].drop_in)


def dit_layers(modules: Iterable[nn.Module]) -> list[LocalAttention]:
    """Every ``LocalAttention`` of the given DiT modules (``transformer``, ``transformer_2``)."""
    out = []
    for m in modules:
        out.extend(x for x in m.modules() if isinstance(x, LocalAttention))
    return out


def keeps_backend(layer: LocalAttention) -> bool:
    """A layer whose model declares its backend *required* for correctness keeps it under every
    request-scoped switch (as upstream: such layers keep it even when the surroundings change)."""
    return layer.spec.required_backend is not None


def request_backends(layers: Iterable[LocalAttention], state: Optional[RequestState]) -> list[str]:
    """The backend names ``layers`` run under ``state`` (None: the server default), in layer order
    without duplicates: the request's table entry where there is one, else the layer's backend,
    plus a per-call fallback the layer has actually used."""
    table = state.override_table if state is not None and state.override_table else {}
    out: list[str] = []
    for layer in layers:
        entry = table.get(id(layer))
        for b in [entry[0]] if entry is not None else layer.decision.ran_backends():
            if b.value not in out:
                out.append(b.value)
    return out


def _refuse(msg: str):
    log.warning("request refused: %s", msg)
    raise AttentionConfigError(msg)


def validate_override(name, layers: list[LocalAttention], settings: AttentionSettings) -> Optional[B]:
    """Check a per-request override (a dense backend for every switchable DiT layer, all or nothing; layers
    with a required backend keep it); return the backend or raise with the reason."""
    if name is None or name == "":
        return None
    try:
        backend = B.from_name(name)
    except AttentionConfigError as exc:
        _refuse(f"attention_backend_override: {exc}")
    if backend not in DROP_IN:
        _refuse(
            f"attention_backend_override '{backend.value}' is not a per-request drop-in backend; "
            f"accepted: {', '.join(b.value for b in DROP_IN)}"
        )
    if settings.compiled:
        _refuse(
            "attention_backend_override is refused: the DiT runs under torch.compile, which bakes "
            "the attention kernel into the traced graph"
        )
    if settings.cuda_graphs:
        _refuse(
            "attention_backend_override is refused: the DiT runs captured CUDA graphs, which bake "
            "the attention kernel into the graph"
        )
    sparse = sorted({l.backend.value for l in layers if SPECS[l.backend].sparse and not keeps_backend(l)})
    if sparse:
        _refuse(
            f"attention_backend_override is refused: the DiT runs the sparse backend "
            f"{', '.join(sparse)}, which cannot be mixed with a per-request dense switch"
        )
    if settings.ring_degree > 1 and not SPECS[backend].returns_lse:
        _refuse(
            f"attention_backend_override '{backend.value}' is refused: ring parallelism "
            f"(ring degree {settings.ring_degree}) needs a backend that returns the softmax LSE"
        )
    return backend


def prepare_request_override(
    dit_modules: Iterable[nn.Module],
    name=None,
    settings: Optional[AttentionSettings] = None,
    skip_softmax: "SkipSoftmaxParams | dict | None" = None,
    dtype=None,
    layers: Optional[list[LocalAttention]] = None,
) -> RequestState:
    """Validate and prepare a request's attention state for every DiT layer, all or nothing.

    dit_modules: the DiT components; name: ``attention_backend_override`` (None = server default);
    skip_softmax: ``{threshold_scale_factor > 0, start_step >= 0}`` or None; dtype: the run's
    compute dtype (defaults to each layer's construction dtype); layers: ``dit_layers(dit_modules)``
    computed once by a caller that serves many requests (the module walk is skipped). Raises
    AttentionConfigError with the reason (and logs it) if any layer cannot switch; on success nothing
    global changed.
    """
    settings = settings or AttentionSettings()
    layers = dit_layers(dit_modules) if layers is None else layers
    backend = validate_override(name, layers, settings)
    ss = parse_skip_softmax(skip_softmax)
    platform = current_platform()
    table: dict = {}
    if backend is not None:
        for layer in layers:
            if keeps_backend(layer):
                continue
            req = layer.spec.request()
            if dtype is not None:
                req = dataclasses.replace(req, dtype=dtype)
            if settings.ring_degree > 1 and layer.role == "self":
                req = dataclasses.replace(req, needs_lse=True)
            reasons = SPECS[backend].reasons(req, platform)
            if reasons:
                sub = substitute(backend, req, platform)
                if sub is not None:
                    _refuse(
                        f"attention_backend_override '{backend.value}' is refused: this platform would run "
                        f"{sub[0].value} instead ({sub[1]}); a per-request override is never substituted"
                    )
                _refuse(
                    f"attention_backend_override '{backend.value}' cannot serve "
                    f"{layer.component}.{layer.prefix} ({layer.role}): {'; '.join(reasons)}"
                )
            table[id(layer)] = (backend, get_impl(backend), validate_backend_config(backend, {}))
    if ss is not None:
        if backend is not None and backend is not B.FA:
            _refuse(
                f"skip_softmax_params cannot be combined with attention_backend_override '{backend.value}': "
                "skip softmax runs on the FA path (dense FA before start_step); accepted: no override, or fa"
            )
        _install_skip_softmax(layers, ss, settings, table, platform, dtype)
    return RequestState(override=backend, override_table=table or None, skip_softmax=ss)


def parse_skip_softmax(value) -> Optional[SkipSoftmaxParams]:
    """``{threshold_scale_factor, start_step}`` → SkipSoftmaxParams; raise with the reason if invalid."""
    if value is None:
        return None
    if isinstance(value, SkipSoftmaxParams):
        value = {"threshold_scale_factor": value.threshold_scale_factor, "start_step": value.start_step}
    if not isinstance(value, dict):
        _refuse("skip_softmax_params must be an object {threshold_scale_factor, start_step}")
    unknown = set(value) - {"threshold_scale_factor", "start_step"}
    if unknown:
        _refuse(f"skip_softmax_params: unknown key(s) {sorted(unknown)}; accepted: threshold_scale_factor, start_step")
    tsf = value.get("threshold_scale_factor")
    if tsf is None:
        _refuse("skip_softmax_params.threshold_scale_factor is required (no default: calibrate it per model)")
    if isinstance(tsf, bool) or not isinstance(tsf, (int, float)) or not tsf > 0 or tsf == float("inf"):
        _refuse(f"skip_softmax_params.threshold_scale_factor must be a positive number, got {tsf!r}")
    start = value.get("start_step", 0)
    if start is None:
        start = 0
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        _refuse(f"skip_softmax_params.start_step must be an integer >= 0, got {start!r}")
    return SkipSoftmaxParams(float(tsf), int(start))


SKIP_SOFTMAX_SM = (90, 100, 103, 107)


def skip_softmax_platform_reasons(platform) -> list[str]:
    """Why skip softmax cannot run on ``platform`` (Triton kernel on Hopper/Blackwell; PyTorch
    reference of the same tile rule on the CPU)."""
    if platform.name == "cpu":
        return []
    if platform.name == "cuda" and platform.sm in SKIP_SOFTMAX_SM and platform.has_package("triton"):
        return []
    where = f"{platform.name}" + (f" SM{platform.sm}" if platform.sm else "")
    return [
        f"skip softmax needs Hopper SM90 or Blackwell SM100/SM103/SM107 with Triton (this is {where}); "
        "the CPU runs its reference path"
    ]


def _install_skip_softmax(layers, ss: SkipSoftmaxParams, settings, table, platform, dtype) -> None:
    from ditattn.attention.kernels import skip_softmax_rules as kernel  # no Triton needed to validate

    if settings.compiled:
        _refuse(
            "skip_softmax_params is refused: the DiT runs under torch.compile, which bakes the "
            "attention kernel into the traced graph"
        )
    if settings.cuda_graphs:
        _refuse("skip_softmax_params is refused: the DiT runs captured CUDA graphs")
    reasons = skip_softmax_platform_reasons(platform)
    if reasons:
        _refuse("skip_softmax_params is refused: " + "; ".join(reasons))
    self_layers = [l for l in layers if l.role == "self" and not keeps_backend(l)]
    if not self_layers:
        _refuse(
            "skip_softmax_params is refused: the model has no DiT self-attention layer that may switch "
            "(layers with a required backend keep it)"
        )
    for layer in self_layers:
        try:
            kernel.check_skip_softmax_request(
                dtype=dtype or layer.spec.dtype,
                head_dim=layer.head_dim,
                role=layer.role,
                has_mask=layer.spec.needs_bias,
                causal=layer.causal,
                ring_degree=settings.ring_degree,
                threshold_scale_factor=ss.threshold_scale_factor,
                start_step=ss.start_step,
            )
        except AttentionConfigError as exc:
            _refuse(f"skip_softmax_params is refused for {layer.component}.{layer.prefix}: {exc}")
        # as upstream, the layer goes to the FA path: dense FA before start_step (the platform's
        # resolution of fa: torch_sdpa where no FlashAttention runs), skip softmax from start_step
        req = dataclasses.replace(layer.spec.request(), dtype=dtype or layer.spec.dtype)
        dense, why, reasons = resolve_on_platform(B.FA, req, platform)
        if reasons:
            _refuse(
                f"skip_softmax_params is refused for {layer.component}.{layer.prefix}: its dense phase "
                f"runs fa, which cannot serve it: {'; '.join(reasons)}"
            )
        if why:
            log.info(
                "skip softmax on %s.%s: dense phase fa -> %s: %s", layer.component, layer.prefix, dense.value, why
            )
        table[id(layer)] = (dense, _skip_softmax_impl(kernel, ss, get_impl(dense), {}), {})


def _skip_softmax_impl(kernel, ss: SkipSoftmaxParams, dense_impl, dense_cfg):
    """A backend impl that runs skip softmax from ``start_step`` on and ``dense_impl`` (the FA
    path) before it and where :mod:`ditattn.attention.skip_route` finds it faster (short calls; on SM90 a
    layer whose first call skipped too few tiles); each call from ``start_step`` on appends its skipped-tile
    fraction (0 when dense) to the request's stats."""
    from ditattn.attention.context import current_request
    from ditattn.attention.skip_route import LayerRoute
    from ditattn.attention.sparse.fallback import note_dense_once

    route = LayerRoute()  # one impl per layer and request

    def impl(q, k, v, call: AttnCall, config):
        if call.step is not None and call.step < ss.start_step:
            return dense_impl(q, k, v, call, dense_cfg)
        if call.attn_bias is not None or call.causal:
            raise AttentionConfigError("skip softmax cannot run with an attention mask")
        why = route.dense_reason(q)
        if why:  # the dense kernel is faster here (ditattn.attention.skip_route)
            note_dense_once("skip_softmax", call, why)
            state = current_request()
            if state is not None:
                state.stats.setdefault("skip_softmax_fractions", []).append(0.0)
            return dense_impl(q, k, v, call, dense_cfg)
        if q.is_cuda:
            from ditattn.attention.kernels.skip_softmax import skip_softmax_attention

            out, lse, frac = skip_softmax_attention(
                q, k, v, threshold_scale_factor=ss.threshold_scale_factor, scale=call.scale, return_lse=call.return_lse
            )
        else:
            out, lse, frac = kernel.skip_softmax_reference(
                q, k, v, threshold_scale_factor=ss.threshold_scale_factor, scale=call.scale, return_lse=call.return_lse
            )
        route.record(frac)
        state = current_request()
        if state is not None:
            state.stats.setdefault("skip_softmax_fractions", []).append(frac)
        return out, lse

    return impl


def skipped_fraction(state: RequestState) -> Optional[float]:
    """Mean fraction of tiles skipped over the request's skip-softmax calls (None if none ran)."""
    fr = state.stats.get("skip_softmax_fractions") if state is not None else None
    if not fr:
        return None
    return float(sum(float(f) for f in fr) / len(fr))
