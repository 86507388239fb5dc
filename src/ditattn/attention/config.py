"""``--attention-backend-config`` and ``--component-attention-backends``: parsing and schemas.

Config parsing order (DESIGN 2.6): an existing ``.json``/``.yaml``/``.yml`` file → a JSON object
string → ``k=v`` pairs split on commas.  Each backend validates its own keys against the schema
below (the seed's parameter tables, plus the parameters of the in-tree algorithms that the seed
leaves unnamed); unknown keys, wrong types and out-of-range values raise
:class:`AttentionConfigError` naming the key and what is accepted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, Iterable

from ditattn.attention.names import AttentionBackendEnum
from ditattn.errors import AttentionConfigError

# ------------------------------------------------------------------------------------------------
# raw parsing


def _scalar(text: str) -> Any:
    t = text.strip()
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(t)
    except ValueError:
        pass
    try:
        f = float(t)
        if math.isfinite(f):
            return f
    except ValueError:
        pass
    if t[:1] in "[{":
        try:
            return json.loads(t)
        except json.JSONDecodeError:
            raise AttentionConfigError(f"malformed JSON value {t!r} in attention backend config") from None
    return t


def _split_pairs(text: str) -> list[str]:
    """Split ``k=v,k=v`` on top-level commas; a piece without '=' continues the previous value
    (so ``dense_layers=0,1`` keeps ``0,1``) and brackets group (``chunk=[2,4]``)."""
    parts, buf, depth = [], [], 0
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    parts.append("".join(buf))
    merged: list[str] = []
    for p in parts:
        if "=" not in p and merged:
            merged[-1] += "," + p
        else:
            merged.append(p)
    return merged


def parse_attention_backend_config(value: "str | dict | None") -> dict:
    """Parse ``--attention-backend-config`` into a dict (no schema validation).

    Accepts None/'' (→ {}), a dict (copied), a path to a ``.json``/``.yaml``/``.yml`` file, a JSON
    object string, or ``k=v[,k=v...]`` pairs where ``true``/``false`` become bools, integers and
    decimals become numbers, ``[..]`` is parsed as JSON, and anything else stays a string.
    """
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise AttentionConfigError(
            f"attention backend config must be a string or a dict, got {type(value).__name__}"
        )
    text = value.strip()
    if not text:
        return {}
    lower = text.lower()
    # a path ending in .json inside k=v pairs (mask_strategy_file_path=/x/m.json) is not a config file
    if (lower.endswith((".json", ".yaml", ".yml")) and "=" not in text) or os.path.isfile(text):
        if not os.path.isfile(text):
            raise AttentionConfigError(f"attention backend config file not found: {text}")
        with open(text, encoding="utf-8") as fh:
            body = fh.read()
        try:
            if lower.endswith(".json"):
                data = json.loads(body)
            else:
                import yaml

                data = yaml.safe_load(body)
        except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
            mark = getattr(exc, "problem_mark", None)  # YAML: keep it to one line, with the position
            why = f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else exc
            raise AttentionConfigError(f"cannot parse attention backend config file {text}: {why}; accepted: "
                                       "a JSON object or YAML mapping of backend parameters") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise AttentionConfigError(
                f"attention backend config file {text} must hold a mapping of parameters, "
                f"got {type(data).__name__}"
            )
        return data
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AttentionConfigError(f"attention backend config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise AttentionConfigError("attention backend config JSON must be an object")
        return data
    out: dict[str, Any] = {}
    for piece in _split_pairs(text):
        if "=" not in piece:
            raise AttentionConfigError(
                f"cannot parse attention backend config {value!r}: expected a .json/.yaml file path, "
                "a JSON object, or key=value pairs separated by commas"
            )
        key, _, raw = piece.partition("=")
        key = key.strip()
        if not key:
            raise AttentionConfigError(f"empty key in attention backend config {value!r}")
        out[key] = _scalar(raw)
    return out


# ------------------------------------------------------------------------------------------------
# schemas


@dataclasses.dataclass(frozen=True)
class Param:
    """One backend parameter: type ('int','float','bool','str','list[int]','int|str'), default,
    an optional check returning an error fragment, and accepted choices."""

    name: str
    type: str
    default: Any
    help: str
    required: bool = False
    choices: tuple | None = None
    check: Callable[[Any], "str | None"] | None = None
    accepted: str = ""  # text describing the accepted range for messages

    def coerce(self, backend: str, value: Any) -> Any:
        def bad(extra: str = "") -> AttentionConfigError:
            acc = self.accepted or (f"one of {list(self.choices)}" if self.choices else f"a {self.type}")
            return AttentionConfigError(
                f"{backend}: invalid value {value!r} for '{self.name}'{extra}; accepted: {acc}"
            )

        t = self.type
        if t == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(" (must be an integer)")
        elif t == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(" (must be a number)")
            value = float(value)
        elif t == "bool":
            if not isinstance(value, bool):
                raise bad(" (must be true or false)")
        elif t == "str":
            if not isinstance(value, str):
                value = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
            if not isinstance(value, str):
                raise bad(" (must be a string)")
        elif t.startswith("list[int]"):
            if isinstance(value, int) and not isinstance(value, bool):
                value = [value]
            if isinstance(value, str):
                value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
                try:
                    value = [int(v) for v in value]
                except ValueError:
                    raise bad(" (must be a list of integers)") from None
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise bad(" (must be a list of integers)")
            value = list(value)
        elif t == "int|str":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise bad()
        if self.choices is not None and value not in self.choices:
            raise bad()
        if self.check is not None:
            msg = self.check(value)
            if msg:
                raise bad(f" ({msg})")
        return value


def _in(lo, hi, lo_open=False, hi_open=False):
    def check(v):
        ok_lo = v > lo if lo_open else v >= lo
        ok_hi = v < hi if hi_open else v <= hi
        return None if ok_lo and ok_hi else "out of range"

    return check


def _nonneg(v):
    return None if v >= 0 else "must be >= 0"


def _positive(v):
    return None if v > 0 else "must be > 0"


def parse_layer_list(v: "str | int | list") -> list[int]:
    """``"0,1"`` / ``"0-2"`` / ``[0, 1]`` / ``3`` → sorted unique layer indices."""
    if isinstance(v, bool):
        raise ValueError("not a layer list")
    if isinstance(v, int):
        items = [v]
    elif isinstance(v, (list, tuple)):
        items = list(v)
    else:
        items = []
        for part in str(v).replace(" ", "").split(","):
            if not part:
                continue
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                a, b = int(a), int(b)
                if b < a:
                    raise ValueError(f"empty range {part}")
                items.extend(range(a, b + 1))
            else:
                items.append(int(part))
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in items):
        raise ValueError("layer indices must be non-negative integers")
    return sorted(set(items))


def _layer_list_check(v):
    try:
        parse_layer_list(v)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def _list_len(n, positive=True):
    def check(v):
        if len(v) != n:
            return f"needs exactly {n} integers"
        if positive and any(i <= 0 for i in v):
            return "sizes must be positive"
        return None

    return check


def _kv_splits_check(v):
    if isinstance(v, str):
        return None if v == "auto" else "must be 'auto' or a positive integer"
    return None if v > 0 else "must be 'auto' or a positive integer"


P = Param
SCHEMAS: dict[str, tuple[Param, ...]] = {
    "sliding_tile_attn": (
        P("mask_strategy_file_path", "str", None, "Path to the mask strategy JSON ('t_l_h' -> [wt, wh, ww] in tiles); written by STA_searching/STA_tuning", required=True, accepted="a path to a JSON file"),
        P("sta_mode", "str", "STA_inference", "STA mode", choices=("STA_inference", "STA_searching", "STA_tuning", "STA_tuning_cfg")),
        P("skip_time_steps", "int", 15, "Steps of full attention before switching to sparse", check=_nonneg, accepted="an integer >= 0"),
        P("tile_size", "list[int]", [4, 4, 4], "Tile size (T, H, W) in latent tokens after patching", check=_list_len(3), accepted="3 positive integers"),
        P("window_candidates", "list[int]", [], "STA_searching: flattened list of candidate windows [wt,wh,ww,...] (empty = built-in set)", check=lambda v: None if len(v) % 3 == 0 else "length must be a multiple of 3", accepted="a multiple of 3 integers"),
    ),
    "video_sparse_attn": (
        P("sparsity", "float", 0.0, "Fraction of key tiles skipped per query tile (0.0 - 1.0)", check=_in(0.0, 1.0), accepted="a number in [0, 1]"),
    ),
    "sparge_attn": (
        P("topk", "float", 0.5, "Fraction of predicted attention blocks kept per head", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("block_size", "int", 64, "Block size in tokens for the block importance prediction", choices=(32, 64, 128)),
        P("quantize", "bool", True, "Kept blocks with INT8 Q.K per block (SageAttention-style, as upstream); false: exact kept blocks"),
    ),
    "video_sparse_attn_h3": (
        P("VSA_sparsity", "float", 0.9, "Fraction of video tiles excluded from top-k", check=_in(0.0, 1.0), accepted="a number in [0, 1]"),
        P("vsa_mode", "str", "exempt", "exempt: non-video keys always selected; compete: they compete in top-k", choices=("exempt", "compete")),
        P("vsa_dense_first_n_steps", "int", 0, "Dense attention for the first N denoising steps", check=_nonneg, accepted="an integer >= 0"),
        P("vsa_dense_layers", "list[int]", [], "Layer indices kept dense, e.g. [0, 1]", check=lambda v: None if all(i >= 0 for i in v) else "indices must be >= 0", accepted="a list of non-negative integers"),
        P("vsa_tile_size", "int", 64, "Kernel tile size; only 64 (the trained (4,4,4) geometry)", choices=(64,)),
    ),
    "hybrid_window_attn_h3": (
        P("vdn_h3_dense_smoke", "bool", False, "Allow a dense transformer backend (fa) on VDN-H3 weights for base-H3 + LoRA parity smoke tests (skips gates and linear branch)"),
        P("vdn_max_gather_rows", "int", 200000, "Upper bound of K/V rows gathered per windowed FlashAttention call", check=_positive, accepted="an integer > 0"),
    ),
    "vmoba_attn": (
        P("temporal_chunk_size", "int", None, "Chunk size along time (latent frames)", check=_positive, accepted="an integer > 0"),
        P("temporal_topk", "int", None, "Top-k chunks selected along time", check=_positive, accepted="an integer > 0"),
        P("spatial_chunk_size", "list[int]", None, "Chunk size along (H, W)", check=_list_len(2), accepted="2 positive integers"),
        P("spatial_topk", "int", None, "Top-k chunks selected along space", check=_positive, accepted="an integer > 0"),
        P("st_chunk_size", "list[int]", None, "Chunk size along (T, H, W)", check=_list_len(3), accepted="3 positive integers"),
        P("st_topk", "int", None, "Top-k chunks selected spatio-temporally", check=_positive, accepted="an integer > 0"),
        P("moba_select_mode", "str", "threshold", "Selection mode", choices=("threshold", "topk")),
        P("moba_threshold", "float", 0.25, "Threshold for selection (cumulative gate mass)", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("moba_threshold_type", "str", "query_head", "How the threshold is applied", choices=("query_head", "head_global", "overall")),
        P("first_full_step", "int", 12, "Initial steps with full attention", check=_nonneg, accepted="an integer >= 0"),
        P("first_full_layer", "int", 0, "Initial layers with full attention", check=_nonneg, accepted="an integer >= 0"),
        P("temporal_layer", "int", 1, "Layers of temporal chunking per cycle", check=_nonneg, accepted="an integer >= 0"),
        P("spatial_layer", "int", 1, "Layers of spatial chunking per cycle", check=_nonneg, accepted="an integer >= 0"),
        P("st_layer", "int", 1, "Layers of spatio-temporal chunking per cycle", check=_nonneg, accepted="an integer >= 0"),
    ),
    "block_sparse_attn": (
        P("skip_first_steps", "int", 10, "Steps that use laser attention before switching to sparse", check=_nonneg, accepted="an integer >= 0"),
        P("sparsity", "float", 0.2, "Sparsity coefficient", check=_in(0.0, 1.0, lo_open=True, hi_open=True), accepted="a number in (0, 1)"),
    ),
    "sol_attn": (
        P("tau", "float", 1.0, "Routing threshold scale; higher keeps fewer exact KV blocks", check=_positive, accepted="a number > 0"),
        P("thresh_type", "str", "diag", "Threshold mode", choices=("diag", "exact")),
        P("sink_tokens", "int", 0, "Length of the exact KV sink (prefix tokens such as text rows)", check=_nonneg, accepted="an integer >= 0"),
        P("sink_start", "int", 0, "Start index of the exact KV sink range", check=_nonneg, accepted="an integer >= 0"),
        P("dense_steps", "int", 10, "Dense attention for the first N denoising steps", check=_nonneg, accepted="an integer >= 0"),
        P("dense_layers", "str", "0,1", "Layer indices kept dense, e.g. 0,1 or 0-2", check=_layer_list_check, accepted="comma-separated indices or ranges like 0,1 or 0-2"),
        P("dense_backend", "str", "fa", "Backend for the dense prefix: fa or sage_attn (approximate)", choices=("fa", "sage_attn")),
        P("kv_splits", "int|str", "auto", "KV split factor passed to the kernel; auto for long sequences", check=_kv_splits_check, accepted="'auto' or a positive integer"),
    ),
    "sla_attn": (
        P("topk", "float", 0.2, "Fraction of key blocks per query block computed exactly (critical)", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("negligible_fraction", "float", 0.0, "Fraction of key blocks skipped outright (lowest mass); the rest go through the linear branch", check=_in(0.0, 1.0, hi_open=True), accepted="a number in [0, 1)"),
        P("block_size", "int", 64, "Block size in tokens", choices=(32, 64, 128)),
    ),
    "sparse_video_gen_2_attn": (
        P("num_q_clusters", "int", 64, "k-means clusters of queries per head", check=_positive, accepted="an integer > 0"),
        P("num_k_clusters", "int", 128, "k-means clusters of keys per head", check=_positive, accepted="an integer > 0"),
        P("kmeans_iters", "int", 5, "k-means iterations of a cold start (first step of a request)", check=_positive, accepted="an integer > 0"),
        P("warm_iters", "int", 1, "k-means iterations of later steps, started from the previous step's centroids of the layer", check=_positive, accepted="an integer > 0"),
        P("recluster_every", "int", 1, "cluster every N-th step; the steps between reuse the cached permutation and block lists", check=_positive, accepted="an integer > 0"),
        P("top_p", "float", 0.9, "Cumulative estimated attention mass kept per query cluster", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("first_full_steps", "int", 0, "Dense attention for the first N denoising steps", check=_nonneg, accepted="an integer >= 0"),
    ),
    "subblock_sparse_attn": (
        P("compute_mode", "str", "bf16", "bf16, or sage_fp8 (SM90 only, needs SpargeAttn)", choices=("bf16", "sage_fp8")),
    ),
}


def schema_for(backend: AttentionBackendEnum) -> tuple[Param, ...]:
    from ditattn.attention.specs import SPECS

    key = SPECS[backend].config_schema
    return SCHEMAS.get(key, ()) if key else ()


def validate_backend_config(backend, raw: dict, *, strict_unknown: bool = True) -> dict:
    """Validate ``raw`` against ``backend``'s schema and return the full config with defaults.

    Unknown keys raise :class:`AttentionConfigError` (unless ``strict_unknown`` is False, when keys
    of other backends may be present), as do missing required keys, wrong types and values out of
    range.
    """
    backend = AttentionBackendEnum.from_name(backend)
    params = {p.name: p for p in schema_for(backend)}
    if strict_unknown:
        unknown = [k for k in raw if k not in params]
        if unknown:
            acc = ", ".join(params) if params else "none (this backend takes no parameters)"
            raise AttentionConfigError(
                f"{backend.value}: unknown config key(s) {', '.join(map(repr, unknown))}; accepted keys: {acc}"
            )
    out = {}
    for name, p in params.items():
        if name in raw and raw[name] is not None:
            out[name] = p.coerce(backend.value, raw[name])
        elif p.required:
            raise AttentionConfigError(
                f"{backend.value}: config key '{name}' is required ({p.help}); pass it with "
                f"--attention-backend-config {name}=..."
            )
        else:
            out[name] = p.default
    return out


def check_config_keys_used(raw: dict, backends: Iterable[AttentionBackendEnum]) -> None:
    """Every key of ``raw`` must belong to the schema of at least one backend in use."""
    backends = list(dict.fromkeys(backends))
    known = {p.name for b in backends for p in schema_for(b)}
    unused = [k for k in raw if k not in known]
    if unused:
        names = ", ".join(b.value for b in backends) or "none"
        acc = ", ".join(sorted(known)) or "none"
        raise AttentionConfigError(
            f"config key(s) {', '.join(map(repr, unused))} belong to no backend in use "
            f"(backends in use: {names}; their keys: {acc})"
        )


# ------------------------------------------------------------------------------------------------
# --component-attention-backends


def parse_component_overrides(value: "str | dict | None") -> dict[str, AttentionBackendEnum]:
    """Parse ``text_encoder=torch_sdpa,transformer.cross=fa`` or a JSON object.

    Returns ``{key: backend}`` where a key is a ``model_index.json`` module name optionally
    followed by ``.self`` or ``.cross``.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise AttentionConfigError(f"--component-attention-backends is not valid JSON: {exc}") from None
            if not isinstance(data, dict):
                raise AttentionConfigError("--component-attention-backends JSON must be an object")
        else:
            data = {}
            for piece in text.split(","):
                if not piece.strip():
                    continue
                if "=" not in piece:
                    raise AttentionConfigError(
                        f"cannot parse component override {piece!r}: expected component=backend "
                        "(e.g. text_encoder=torch_sdpa,transformer.cross=fa) or a JSON object"
                    )
                k, _, v = piece.partition("=")
                data[k.strip()] = v.strip()
    elif isinstance(value, dict):
        data = value
    else:
        raise AttentionConfigError("component attention backends must be a string or a dict")
    out: dict[str, AttentionBackendEnum] = {}
    for key, name in data.items():
        key = str(key).strip()
        comp, dot, role = key.partition(".")
        if not comp or (dot and role not in ("self", "cross")):
            raise AttentionConfigError(
                f"bad component override key {key!r}: use a model_index.json module name, optionally "
                "with a role suffix .self or .cross (e.g. transformer.cross)"
            )
        out[key] = AttentionBackendEnum.from_name(name)
    return out


def component_override_for(
    overrides: dict[str, AttentionBackendEnum], component: str, role: str
) -> tuple[AttentionBackendEnum, str, str] | None:
    """The override that applies to ``component``/``role``: ``(backend, key, source)``.

    A role key beats the component key; ``transformer_2`` (any ``X_2``) inherits ``X``'s keys
    unless it has keys of its own.
    """
    own = [component]
    if component.endswith("_2") and not any(k.split(".")[0] == component for k in overrides):
        own.append(component[:-2])
    for comp in own:
        if f"{comp}.{role}" in overrides:
            return overrides[f"{comp}.{role}"], f"{comp}.{role}", "component_role"
        if comp in overrides:
            return overrides[comp], comp, "component"
    return None
