"""LoRA adapters for the native Wan DiT: diffusers / PEFT-format files loaded into its linear layers,
fused into the weights or kept apart (unfused) with scales that a request can change.

Files are read with diffusers' ``WanLoraLoaderMixin.lora_state_dict`` — the same reader
``WanPipeline.load_lora_weights`` uses, so diffusers-format, PEFT-format and the original Wan /
ComfyUI / musubi layouts (converted by diffusers) all load, and the numbers are diffusers': a module
whose ``lora_A`` has rank ``r`` adds ``scale * (alpha / r) * lora_B(lora_A(x))`` (``alpha / sqrt(r)``
with ``use_rslora``), where ``alpha`` comes from the file's LoRA metadata (``lora_alpha``,
``alpha_pattern``, as ``save_lora_weights`` writes it) and is ``r`` when the file has none, and
``scale`` is the user's (``path:scale``).  The native DiT keeps diffusers' module names, so the keys
map one to one (``transformer.blocks.0.attn1.to_q.lora_A.weight`` -> ``blocks.0.attn1.to_q``).

Full-weight deltas: files in the original Wan layout (``diffusion_model.blocks.0.self_attn.q.lora_down.weight``,
``lora_up``, ``alpha``), as the step-distill LoRAs of LightX2V and Kijai's extractions ship, also carry
``<param>.diff`` (a weight delta: norms, ``patch_embedding``, ``modulation``, ``head.head``) and
``<module>.diff_b`` (a bias delta) tensors.  ditattn takes them out before diffusers' reader (which
drops most of them), renames them with diffusers' Wan checkpoint converter
(``blocks.0.norm3`` -> ``blocks.0.norm2``, ``head.modulation`` -> ``scale_shift_table``) and adds
``scale * delta`` to the parameter at load time — also for unfused adapters, whose request scales then
change the low-rank part only.

Unfused adapters live in :class:`LoRALinear` (an ``nn.Linear`` sharing the base weight, so every
reader of ``.weight`` still works); the scales in effect are a context variable
(:func:`lora_scales`), so concurrent requests cannot see each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
import re
from typing import Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ditattn.attention.names import DIT_COMPONENTS
from ditattn.errors import AttentionConfigError, short_repr

LORA_COMPONENTS = DIT_COMPONENTS


class LoRAError(AttentionConfigError):
    """A LoRA file or specification that cannot be applied (message says why and what is accepted)."""


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """One ``--lora-path`` value: ``[COMPONENT=]PATH[:SCALE]`` (component ``transformer`` unless
    given; ``transformer_2`` is a two-expert checkpoint's low-noise expert)."""

    path: str
    scale: float = 1.0
    component: str = "transformer"

    @property
    def name(self) -> str:
        """The adapter's default name: the file (or folder) name without its extension; the folder's
        name for diffusers' default file name ``pytorch_lora_weights.safetensors``."""
        path = os.path.normpath(os.path.expanduser(self.path))
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem == "pytorch_lora_weights" and os.path.basename(os.path.dirname(path)):
            return os.path.basename(os.path.dirname(path))
        return stem or os.path.basename(path)


def parse_lora_spec(text: str) -> LoRASpec:
    """``[COMPONENT=]PATH[:SCALE]`` -> :class:`LoRASpec`; the scale is a finite number (default 1.0).
    A trailing ``:X`` that is not a number stays part of the path."""
    if not isinstance(text, str) or not text.strip():
        raise LoRAError("--lora-path needs a value: [COMPONENT=]PATH[:SCALE], e.g. style.safetensors:0.8")
    text = text.strip()
    component = "transformer"
    head, eq, rest = text.partition("=")
    if eq and head in LORA_COMPONENTS:
        component, text = head, rest
    elif eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head) and not os.path.exists(text):
        raise LoRAError(
            f"--lora-path {short_repr(text)}: component {short_repr(head)} takes no LoRA; accepted: "
            f"{', '.join(LORA_COMPONENTS)}"
        )
    path, scale = text, 1.0
    stem, colon, tail = text.rpartition(":")
    if colon and stem:
        try:
            scale = float(tail)
        except ValueError:
            pass
        else:
            if not math.isfinite(scale):
                raise LoRAError(
                    f"--lora-path {short_repr(text)}: the scale must be a finite number, got {short_repr(tail)}"
                )
            path = stem
    return LoRASpec(path, scale, component)


# ------------------------------------------------------------------------------------------------
# reading files


@dataclasses.dataclass
class LoRAWeights:
    """One adapter read from a file: ``modules`` maps a module name of the DiT (``blocks.0.attn1.to_q``)
    to ``(A [r, in], B [out, r], B bias [out] | None, alpha / r scaling)``."""

    name: str
    modules: dict
    #: full-weight deltas: DiT parameter name (``blocks.0.norm2.weight``) -> tensor of its shape
    deltas: dict = dataclasses.field(default_factory=dict)


DELTA_SUFFIXES = (".diff", ".diff_b")


def _split_deltas(path: str) -> Optional[tuple[dict, dict]]:
    """``(the file's low-rank tensors, {DiT parameter name: delta})`` for an original-layout
    ``.safetensors`` file with ``.diff`` / ``.diff_b`` or ``.alpha`` tensors (module docstring), else
    None.  Each ``<m>.alpha`` is folded into ``<m>.lora_down.weight`` (times ``alpha / rank``), as
    diffusers' converter does for the blocks, so it also holds for the embedders and ``time_projection``."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not (os.path.isfile(path) and path.endswith(".safetensors")):
        return None
    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
            if not any(k.startswith("diffusion_model.") for k in keys) or not any(
                k.endswith((*DELTA_SUFFIXES, ".alpha")) for k in keys
            ):
                return None
        state = load_file(path)
    except Exception:  # noqa: BLE001 - an unreadable file (SafetensorError, OSError): diffusers' reader reports it
        return None
    for key in [k for k in state if k.endswith(".alpha")]:
        down = next(
            (
                key[: -len("alpha")] + d
                for d in ("lora_down.weight", "lora_A.weight")
                if key[: -len("alpha")] + d in state
            ),
            None,
        )
        if down is not None:
            alpha = state.pop(key)
            state[down] = state[down] * (float(alpha) / state[down].shape[0])
    deltas = {}
    for key in [k for k in state if k.endswith(DELTA_SUFFIXES)]:
        tensor = state.pop(key)
        stem = key.removeprefix("diffusion_model.").rpartition(".")[0]
        param = stem + (".bias" if key.endswith(".diff_b") else "" if stem.endswith("modulation") else ".weight")
        (name,) = convert_wan_transformer_to_diffusers({param: tensor}).keys()  # one key in, one out
        deltas[name] = tensor
    return state, deltas


def _alpha_for(module: str, rank: int, meta: Mapping) -> float:
    """diffusers' / PEFT's alpha of ``module``: ``alpha_pattern`` (a key matching the module name or
    a dotted suffix of it) else ``lora_alpha``, else the rank (scale 1)."""
    for pattern, alpha in (meta.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{re.escape(pattern)}", module):
            return float(alpha)
    alpha = meta.get("lora_alpha")
    if alpha is None:
        return float(rank)
    return float(alpha)


def _metadata(raw) -> dict:
    """The LoRA config stored with the weights (``save_lora_weights`` keys it ``transformer.<field>``)."""
    if not raw:
        return {}
    if isinstance(raw, str):
        raw = json.loads(raw)
    raw = dict(raw)
    prefixed = {k.partition(".")[2]: v for k, v in raw.items() if k.startswith("transformer.")}
    return prefixed or raw


#: what :func:`read_lora` reads, for its refusals
ACCEPTED_LAYOUTS = (
    "a diffusers / PEFT Wan LoRA (transformer.<module>.lora_A / lora_B) or the original Wan / musubi layouts "
    "(diffusion_model.blocks.N.<module>.lora_down / lora_up, lora_unet_blocks_N_<module>)"
)


def _safetensors_keys(file: str, where: str) -> list[str]:
    """The tensor names of the ``.safetensors`` ``file`` from its header; :class:`LoRAError` for an
    empty, truncated or foreign file (instead of diffusers' "Unable to load weights")."""
    from safetensors import safe_open

    try:
        size = os.path.getsize(file)
    except OSError as exc:
        raise LoRAError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if size == 0:
        raise LoRAError(f"{where}: not a valid safetensors file (0 bytes)")
    try:
        with safe_open(file, "pt") as f:
            return list(f.keys())
    except OSError as exc:
        raise LoRAError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - SafetensorError and the like: the header is not safetensors'
        reason = " ".join(str(exc).split()).removeprefix("Error while deserializing header: ")[:120]
        raise LoRAError(
            f"{where}: not a valid safetensors file ({size} bytes; {reason}); a truncated download or another format?"
        ) from None


def _kohya_key(keys) -> Optional[str]:
    """The first ``lora_down`` / ``lora_up`` key of ``keys`` when they look like a kohya / Stable
    Diffusion LoRA rather than the original Wan or musubi layouts (which diffusers converts), else None."""
    if any(k.startswith(("diffusion_model.", "lora_unet_blocks_")) for k in keys):
        return None
    return next((k for k in keys if ".lora_down." in k or ".lora_up." in k), None)


def _kohya_error(where: str, key: str) -> LoRAError:
    return LoRAError(
        f"{where}: keys look like a kohya / SD LoRA (lora_down / lora_up, e.g. {key[:100]!r}); accepted: "
        + ACCEPTED_LAYOUTS
    )


def read_lora(spec: LoRASpec, name: Optional[str] = None) -> LoRAWeights:
    """Read the adapter of ``spec`` (a ``.safetensors`` file, or a folder holding
    ``pytorch_lora_weights.safetensors``) into :class:`LoRAWeights`; unreadable files (empty,
    truncated, not safetensors), unsupported kinds (DoRA, kohya / SD keys, non-LoRA tensors), malformed
    pairs and NaN / infinite values raise :class:`LoRAError` naming the file (and the tensor)."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    where = f"--lora-path {spec.path}"
    path = os.path.expanduser(spec.path)
    if not os.path.exists(path):
        raise LoRAError(f"{where}: no such file or folder")
    keys: list[str] = []
    if os.path.isdir(path):
        try:
            files = os.listdir(path)
        except OSError as exc:
            raise LoRAError(f"{where}: cannot read the folder ({exc.strerror or exc})") from None
        if not any(f.endswith((".safetensors", ".bin")) for f in files):
            raise LoRAError(
                f"{where}: the folder holds no .safetensors LoRA (expected pytorch_lora_weights.safetensors, as "
                "diffusers' save_lora_weights writes it)"
            )
        if "pytorch_lora_weights.safetensors" in files:
            keys = _safetensors_keys(os.path.join(path, "pytorch_lora_weights.safetensors"), where)
    elif path.endswith(".safetensors"):
        keys = _safetensors_keys(path, where)
    kohya = _kohya_key(keys)
    if kohya is not None:
        raise _kohya_error(where, kohya)
    split = _split_deltas(path)
    kw, deltas, source = {}, {}, path
    if split is not None:
        source, deltas = split  # the rest as a state dict (original-layout files carry no LoRA metadata)
    elif os.path.isfile(path):
        kw = {"weight_name": os.path.basename(path)}
        source = os.path.dirname(path) or "."
    try:
        state, meta = (
            ({}, None)
            if split is not None and not source
            else WanLoraLoaderMixin.lora_state_dict(source, local_files_only=True, return_lora_metadata=True, **kw)
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        msg = " ".join(str(exc).split())[:300]
        raise LoRAError(f"{where}: cannot read a LoRA from it ({msg})") from None
    meta = _metadata(meta)
    if meta.get("use_dora") or any("lora_magnitude_vector" in k for k in state):
        raise LoRAError(f"--lora-path {spec.path}: DoRA adapters are not supported; accepted: plain LoRA")
    bad = [k for k in state if "lora" not in k]
    if bad:
        raise LoRAError(f"--lora-path {spec.path}: not a LoRA file (tensor {bad[0]!r} has no lora_A / lora_B name)")
    for key, tensor in [*state.items(), *deltas.items()]:
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise LoRAError(
                f"{where}: tensor {key!r} holds NaN or infinite values (a damaged or diverged LoRA); "
                "accepted: finite weights"
            )
    rslora = bool(meta.get("use_rslora"))
    groups: dict[str, dict] = {}
    for key, tensor in state.items():
        m = re.fullmatch(r"(?:transformer\.)?(.+)\.(lora_A|lora_B)\.(weight|bias)", key)
        if m is None:
            if _kohya_key([key]) is not None:
                raise _kohya_error(where, key)
            raise LoRAError(
                f"--lora-path {spec.path}: unexpected tensor {key!r} (accepted: "
                "<module>.lora_A.weight, <module>.lora_B.weight, <module>.lora_B.bias)"
            )
        groups.setdefault(m.group(1), {})[f"{m.group(2)}.{m.group(3)}"] = tensor
    modules = {}
    for module, parts in sorted(groups.items()):
        if set(parts) == {"lora_B.bias"}:  # a bias delta without a low-rank pair (e.g. diff_b of the text embedder)
            deltas[f"{module}.bias"] = parts["lora_B.bias"]
            continue
        a, b = parts.get("lora_A.weight"), parts.get("lora_B.weight")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"--lora-path {spec.path}: module {module} lacks a matching lora_A / lora_B pair")
        rank = a.shape[0]
        alpha = _alpha_for(module, rank, meta)
        modules[module] = (a, b, parts.get("lora_B.bias"), alpha / (math.sqrt(rank) if rslora else rank))
    if not modules and not deltas:
        raise LoRAError(f"--lora-path {spec.path}: the file holds no LoRA weights")
    return LoRAWeights(name or spec.name, modules, deltas)


# ------------------------------------------------------------------------------------------------
# applying


_scales: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("ditattn_lora_scales", default=None)


@contextlib.contextmanager
def lora_scales(scales: Optional[Mapping[str, float]]) -> Iterator[None]:
    """Inside the block, unfused adapters run at ``scales`` (adapter name -> scale; adapters not named
    are off); None keeps each adapter's default scale."""
    token = _scales.set(None if scales is None else dict(scales))
    try:
        yield
    finally:
        _scales.reset(token)


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus unfused adapters: ``y = x W^T + b + sum_a s_a * c_a * B_a(A_a(x))`` with
    ``c_a = alpha / r`` and ``s_a`` the adapter's scale in effect (:func:`lora_scales`, else its
    default).  Shares the wrapped layer's ``weight`` / ``bias``."""

    def __init__(self, base: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.lora_B_bias = nn.ParameterDict()
        self.lora_scaling: dict[str, float] = {}
        self.lora_default: dict[str, float] = {}

    def add_adapter(
        self, name: str, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], scaling: float, scale: float
    ) -> None:
        dev, dt = self.weight.device, self.weight.dtype
        self.lora_A[name] = nn.Parameter(a.to(dev, dt), requires_grad=False)
        self.lora_B[name] = nn.Parameter(b.to(dev, dt), requires_grad=False)
        if bias is not None:
            self.lora_B_bias[name] = nn.Parameter(bias.to(dev, dt), requires_grad=False)
        self.lora_scaling[name], self.lora_default[name] = float(scaling), float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        active = _scales.get()
        for name, a in self.lora_A.items():
            s = self.lora_default[name] if active is None else active.get(name, 0.0)
            if s == 0.0:
                continue
            bias = self.lora_B_bias[name] if name in self.lora_B_bias else None
            y = y + F.linear(F.linear(x.to(a.dtype), a), self.lora_B[name], bias) * (s * self.lora_scaling[name])
        return y


def _linear(model: nn.Module, module: str, where: str) -> tuple[nn.Module, str, nn.Linear]:
    parent_name, _, attr = module.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, attr)
    except AttributeError:
        layer = None
    if not isinstance(layer, nn.Linear):
        raise LoRAError(
            f"{where}: the LoRA targets {module}, which is not a linear layer of this transformer "
            "(a LoRA for another model?)"
        )
    return parent, attr, layer


def check_lora(model: nn.Module, weights: LoRAWeights, where: str = "LoRA") -> list:
    """Whether ``weights`` fit ``model`` (each module a linear layer of the right shape, each delta a
    parameter of its shape), without changing it; :class:`LoRAError` naming the first that does not.
    Returns the targets :func:`apply_lora` changes.  The ``--backend diffusers`` path runs it on
    diffusers' transformer before ``load_lora_weights`` so both backends refuse the same files."""
    params = dict(model.named_parameters())
    for pname, delta in weights.deltas.items():
        if pname not in params:
            raise LoRAError(
                f"{where}: the LoRA holds a delta for {pname}, which this transformer does not have "
                "(a LoRA for another model?)"
            )
        if tuple(delta.shape) != tuple(params[pname].shape):
            raise LoRAError(
                f"{where}: {pname} is {tuple(params[pname].shape)} but the LoRA's delta is "
                f"{tuple(delta.shape)} (a LoRA for another model size?)"
            )
    targets = []
    for module, (a, b, bias, scaling) in weights.modules.items():
        parent, attr, layer = _linear(model, module, where)
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise LoRAError(
                f"{where}: {module} is {layer.out_features}x{layer.in_features} but the LoRA is "
                f"{b.shape[0]}x{a.shape[1]} (a LoRA for another model size?)"
            )
        targets.append((module, parent, attr, layer, a, b, bias, scaling))
    return targets


def apply_lora(
    model: nn.Module, weights: LoRAWeights, *, scale: float = 1.0, fuse: bool = False, where: str = "LoRA"
) -> int:
    """Add ``weights`` to ``model``'s linear layers at ``scale``: fused (``W += scale * c * B A``,
    ``b += scale * c * bias_B``) or as a :class:`LoRALinear` adapter named ``weights.name``; its
    full-weight deltas are added to their parameters (``P += scale * delta``) either way.  Shapes
    are checked first (:func:`check_lora`: nothing changes when any module does not fit).  Returns the
    layers and parameters touched."""
    targets = check_lora(model, weights, where)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for pname, delta in weights.deltas.items():
            p = params[pname]
            p.copy_((p.float() + delta.float().to(p.device) * scale).to(p.dtype))
        for module, parent, attr, layer, a, b, bias, scaling in targets:
            if fuse:
                c = scale * scaling
                delta = (b.float() @ a.float()) * c
                layer.weight.copy_((layer.weight.float() + delta.to(layer.weight.device)).to(layer.weight.dtype))
                if bias is not None:
                    if layer.bias is None:
                        raise LoRAError(f"{where}: {module} has no bias to fuse the LoRA's lora_B.bias into")
                    layer.bias.copy_(
                        (layer.bias.float() + bias.float().to(layer.bias.device) * c).to(layer.bias.dtype)
                    )
                continue
            if not isinstance(layer, LoRALinear):
                wrapped = LoRALinear(layer)
                setattr(parent, attr, wrapped)
                layer = wrapped
            if weights.name in layer.lora_A:
                raise LoRAError(
                    f"{where}: an adapter named {weights.name!r} is already loaded; give the files different names"
                )
            layer.add_adapter(weights.name, a, b, bias, scaling, scale)
    return len(targets) + len(weights.deltas)


def adapter_names(model: nn.Module) -> list[str]:
    """The unfused adapters loaded into ``model``, in load order."""
    out: list[str] = []
    for m in model.modules():
        if isinstance(m, LoRALinear):
            out += [n for n in m.lora_A.keys() if n not in out]
    return out


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One loaded LoRA: its name (what requests call it), the component it went into, its default
    scale, whether it is fused into the weights, its file and the linear layers it touches."""

    name: str
    component: str
    scale: float
    fused: bool
    path: str
    layers: int


def load_loras(components: Mapping[str, nn.Module], specs, *, fuse: bool = False) -> list[Adapter]:
    """Load every ``--lora-path`` spec (text or :class:`LoRASpec`) into its component, in order; names
    are the file names, made unique with ``_2``, ``_3``, ...  Raises :class:`LoRAError` for a missing
    component (``transformer_2`` of a single-expert checkpoint), a bad file or a LoRA that does not fit."""
    out: list[Adapter] = []
    for raw in specs:
        spec = raw if isinstance(raw, LoRASpec) else parse_lora_spec(raw)
        model = components.get(spec.component)
        if model is None:
            have = ", ".join(c for c in LORA_COMPONENTS if components.get(c) is not None)
            raise LoRAError(
                f"--lora-path {spec.path}: this checkpoint has no {spec.component} (LoRA targets here: {have})"
            )
        name, k = spec.name, 2
        while any(a.name == name for a in out):
            name, k = f"{spec.name}_{k}", k + 1
        weights = read_lora(spec, name)
        layers = apply_lora(model, weights, scale=spec.scale, fuse=fuse, where=f"--lora-path {spec.path}")
        out.append(Adapter(name, spec.component, spec.scale, fuse, spec.path, layers))
    return out


def resolve_request_lora(request: Optional[Mapping[str, float]], adapters: list[Adapter]) -> Optional[dict]:
    """The scales a request's ``lora`` (adapter name -> scale, adapters not named off; None: the
    defaults) runs unfused adapters at, checked: known names, finite numbers, and adapters that are not
    fused (any mapping, ``{}`` included, is refused for fused adapters: it could not turn them off)."""
    if request is None:
        return None
    if not isinstance(request, Mapping):
        raise LoRAError('lora must be a mapping of adapter name to scale, e.g. {"style": 0.8}')
    names = [a.name for a in adapters]
    if request and not adapters:
        raise LoRAError("lora: this pipeline has no LoRA adapters loaded (start it with --lora-path PATH[:SCALE])")
    if adapters and all(a.fused for a in adapters):  # {} too: it would turn every adapter off
        raise LoRAError(
            "lora: the adapters are fused into the weights (--lora-fuse); per-request scales need unfused adapters"
        )
    out = {}
    for name, scale in request.items():
        if name not in names:
            raise LoRAError(f"lora: unknown adapter {name!r}; loaded: {', '.join(names)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise LoRAError(f"lora: the scale of {name!r} must be a finite number, got {scale!r}")
        out[name] = float(scale)
    return out
