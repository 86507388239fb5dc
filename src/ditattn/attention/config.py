"""``--attention-backend-config`` and ``--component-attention-backends``: parsing and validation.

Config parsing order: an existing ``.json``/``.yaml``/``.yml`` file → a JSON object
string → ``k=v`` pairs split on commas.  Each backend validates its own keys against its schema
(:mod:`ditattn.attention.schemas`); unknown keys, wrong types and out-of-range values raise
:class:`AttentionConfigError` naming the key and what is accepted.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from typing import Any, Callable, Iterable, Optional

from ditattn.attention.names import ROLES, AttentionBackendEnum, role_chain
from ditattn.attention.schemas import SCHEMAS, Param, parse_layer_list, schema_for  # noqa: F401  (re-exported)
from ditattn.errors import AttentionConfigError, short_repr, short_text

# ------------------------------------------------------------------------------------------------
# raw parsing

MAX_FILE_BYTES = 16 << 20  # config and strategy files are small; a bigger one is a mistake


MAX_DEPTH = 100  # nesting of a config value or file: far beyond any real one, far below the parsers' recursion
_JSON_TOKENS = {bytes: re.compile(rb'[\[\]{}"\\]'), str: re.compile(r'[\[\]{}"\\]')}


def json_depth_exceeds(text: "str | bytes", max_depth: int) -> bool:
    """Whether JSON ``text`` nests arrays / objects deeper than ``max_depth`` (brackets inside
    strings do not count).  Linear, without recursion: run before a parser whose recursion a deep
    document would exhaust."""
    if (
        text.count("[" if isinstance(text, str) else b"[") + text.count("{" if isinstance(text, str) else b"{")
        <= max_depth
    ):  # the common case, at C speed
        return False
    opens, closes, quote, backslash = (
        ("[{", "]}", '"', "\\") if isinstance(text, str) else ((b"[", b"{"), (b"]", b"}"), b'"', b"\\")
    )
    depth, in_string, escaped = 0, False, False
    for m in _JSON_TOKENS[type(text)].finditer(text):
        ch = m.group()
        if in_string:
            if escaped:
                escaped = False
            elif ch == backslash:
                escaped = True
            elif ch == quote:
                in_string = False
        elif ch == quote:
            in_string = True
        elif ch in opens:
            depth += 1
            if depth > max_depth:
                return True
        elif ch in closes:
            depth -= 1
    return False


def parse_error_reason(exc: BaseException) -> str:
    """One line on why a JSON / YAML text could not be parsed (nesting too deep, a number too
    long, or the parser's own message with its position)."""
    if isinstance(exc, RecursionError) or "nesting depth" in str(exc):  # the latter: libyaml's words
        return "nested too deeply"
    mark = getattr(exc, "problem_mark", None)  # YAML: keep it to one line, with the position
    if mark is not None:
        return f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    msg = " ".join(str(exc).split())
    if "integer string conversion" in msg:
        return "a number has too many digits"
    return msg[:200]


def unique_keys(what: Optional[str] = None) -> Callable[[list], dict]:
    """A ``json.loads`` ``object_pairs_hook`` refusing a key given twice in one object (JSON parsers keep
    the last silently) with :class:`AttentionConfigError` ``"{what}: key 'k' is given twice; give it once"``."""

    def unique(pairs):
        out = dict(pairs)
        if len(out) < len(pairs):  # a key given twice: find it (one pass)
            seen = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            where = f"{what}: " if what else ""
            raise AttentionConfigError(f"{where}key {short_repr(dup)} is given twice; give it once")
        return out

    return unique


def loads_json(text: str, what: str) -> Any:
    """``json.loads(text)``; malformed JSON, a key given twice in one object, too deep nesting and numbers
    with thousands of digits raise :class:`AttentionConfigError` naming ``what``."""
    if json_depth_exceeds(text, MAX_DEPTH):
        raise AttentionConfigError(f"{what} is not valid JSON: nested too deeply (more than {MAX_DEPTH} levels)")
    try:
        return json.loads(text, object_pairs_hook=unique_keys(what))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        if isinstance(exc, AttentionConfigError):
            raise
        raise AttentionConfigError(f"{what} is not valid JSON: {parse_error_reason(exc)}") from None


def parse_scalar(text: str) -> Any:
    """One ``k=v`` value as the config parsers read it: ``true`` / ``false`` -> bool, ``none`` / ``null`` ->
    None, integers and finite decimals -> numbers, ``[..]`` / ``{..}`` -> JSON, anything else the text."""
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
    if t and t[0] in "[{":
        return loads_json(t, f"the value {short_repr(t)} in the attention backend config")
    return t


def _split_pairs(text: str) -> list[str]:
    """Split ``k=v,k=v`` on top-level commas; a piece without '=' continues the previous value
    (so ``dense_layers=0,1`` keeps ``0,1``), brackets group (``chunk=[2,4]``), and empty pieces
    are dropped (a trailing comma, ``topk=0.5,``, never ends up inside a value)."""
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
        if not p.strip():
            continue  # an empty piece (`k=v,` or `a=1,,b=2`) separates nothing
        if "=" not in p and merged:
            merged[-1] += "," + p
        else:
            merged.append(p)
    return merged


def read_text_file(path: str, *, what: str, accepted: str, max_bytes: Optional[int] = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (at most ``max_bytes``; None: no limit).

    The file is opened without blocking and checked before it is read, so a FIFO, a device or a
    directory is refused at once ("... is not a regular file") instead of hanging on a read that
    never ends.  A missing or unreadable file, a non-regular one, text that is not UTF-8 and a file
    over the limit raise :class:`AttentionConfigError` naming ``what`` and ``accepted``."""
    shown = short_text(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL byte
        raise AttentionConfigError(f"cannot read {what} {shown}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a special file"
            )
            raise AttentionConfigError(
                f"{what} {shown} is not a regular file (it is {kind}); accepted: a regular file holding {accepted}"
            )
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        try:
            raw = fh.read(-1 if max_bytes is None else max_bytes + 1)
        except OSError as exc:
            raise AttentionConfigError(f"cannot read {what} {shown}: {exc.strerror or exc}") from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise AttentionConfigError(f"{what} {shown} is larger than {max_bytes // (1 << 20)} MiB; accepted: {accepted}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AttentionConfigError(
            f"cannot read {what} {shown}: not UTF-8 text (byte {exc.start}); accepted: {accepted}"
        ) from None


@functools.lru_cache(maxsize=1)
def _unique_keys_loader():
    """PyYAML's safe loader (libyaml's when the wheel has it) refusing a key given twice in one mapping
    (YAML itself forbids it; PyYAML keeps the last value silently).  Built once."""
    import yaml

    class UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:  # an unhashable key: construct_mapping's own error says so
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r:.60} appears twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_mapping_file(path: str, *, what: str = "config file", accepted: str = "a YAML or JSON mapping") -> dict:
    """The mapping in the ``.json`` / ``.yaml`` / ``.yml`` file ``path`` ({} for an empty file).

    Unreadable or non-regular files (:func:`read_text_file`), parse errors (one line, with the
    position), a key given twice in one mapping and documents that are not a mapping raise
    :class:`AttentionConfigError` naming ``what`` and ``accepted``.
    """
    body = read_text_file(path, what=what, accepted=accepted)
    is_json, path = str(path).lower().endswith(".json"), short_text(path)
    if json_depth_exceeds(body, MAX_DEPTH):  # YAML flow style nests with the same brackets
        raise AttentionConfigError(
            f"cannot parse {what} {path}: nested too deeply (more than {MAX_DEPTH} levels); accepted: {accepted}"
        )
    try:
        if is_json:
            data = json.loads(body, object_pairs_hook=unique_keys())  # a key given twice, as YAML's loader
        else:
            import yaml

            # libyaml's loader when the wheel has it: fast, and it refuses deep nesting at once
            data = yaml.load(body, Loader=_unique_keys_loader())
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError, RecursionError, int digit limit
        raise AttentionConfigError(
            f"cannot parse {what} {path}: {parse_error_reason(exc)}; accepted: {accepted}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise AttentionConfigError(f"{what} {path} must hold a mapping of parameters, got {type(data).__name__}")
    return data


def parse_attention_backend_config(value: "str | dict | None", *, files: bool = True) -> dict:
    """Parse ``--attention-backend-config`` into a dict (no schema validation).

    Accepts None/'' (→ {}), a dict (copied), a path to a ``.json``/``.yaml``/``.yml`` file, a JSON
    object string, or ``k=v[,k=v...]`` pairs where ``true``/``false`` become bools, integers and
    decimals become numbers, ``[..]`` is parsed as JSON, and anything else stays a string.
    ``files=False`` (text from a network request): the file system is never looked at, and text
    that names a config file is refused.
    """
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise AttentionConfigError(f"attention backend config must be a string or a dict, got {type(value).__name__}")
    text = value.strip()
    if not text:
        return {}
    lower = text.lower()
    names_file = lower.endswith((".json", ".yaml", ".yml")) and "=" not in text
    if not files:
        if names_file or ("=" not in text and not text.startswith("{") and ("/" in text or "\\" in text)):
            raise AttentionConfigError(
                f"attention backend config {short_repr(value)} is not inline: config files are not read here; "
                "accepted: a JSON object or key=value pairs separated by commas"
            )
    # a path ending in .json inside k=v pairs (mask_strategy_file_path=/x/m.json) is not a config file
    elif names_file or os.path.lexists(text):
        if not os.path.lexists(text):
            raise AttentionConfigError(f"attention backend config file not found: {short_text(text)}")
        return load_mapping_file(
            text, what="attention backend config file", accepted="a JSON object or YAML mapping of backend parameters"
        )
    if text.startswith("{"):
        data = loads_json(text, "attention backend config")
        if not isinstance(data, dict):
            raise AttentionConfigError("attention backend config JSON must be an object")
        return data
    out: dict[str, Any] = {}
    pieces = _split_pairs(text)
    if not pieces:
        raise AttentionConfigError(f"attention backend config {short_repr(value)} holds no key=value pair")
    for piece in pieces:
        if "=" not in piece:
            raise AttentionConfigError(
                f"cannot parse attention backend config {short_repr(value)}: expected a .json/.yaml file path, "
                "a JSON object, or key=value pairs separated by commas"
            )
        key, _, raw = piece.partition("=")
        key = key.strip()
        if not key:
            raise AttentionConfigError(f"empty key in attention backend config {short_repr(value)}")
        if key in out:
            raise AttentionConfigError(
                f"key {short_repr(key)} is given twice in attention backend config {short_repr(value)}; give it once"
            )
        out[key] = parse_scalar(raw)
    return out


def _keys(keys: list) -> str:
    """Config keys quoted for an error message: each cut short, at most five named."""
    shown = ", ".join(short_repr(k, 40) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


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
                f"{backend.value}: unknown config key(s) {_keys(unknown)}; accepted keys: {acc}"
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


def complete_backend_config(backend, config: "dict | None") -> dict:
    """``backend``'s full config: ``config`` as given when it already holds every schema key (a
    layer's config, validated when the layer was bound), else validated here with the defaults
    filled in (keys of other backends ignored).  For backend implementations called directly."""
    config = dict(config or {})
    backend = AttentionBackendEnum.from_name(backend)
    if all(p.name in config for p in schema_for(backend)):
        return config
    return validate_backend_config(backend, config, strict_unknown=False)


def check_config_keys_used(raw: dict, backends: Iterable[AttentionBackendEnum]) -> None:
    """Every key of ``raw`` must belong to the schema of at least one backend in use."""
    backends = list(dict.fromkeys(backends))
    known = {p.name for b in backends for p in schema_for(b)}
    unused = [k for k in raw if k not in known]
    if unused:
        names = ", ".join(b.value for b in backends) or "none"
        acc = ", ".join(sorted(known)) or "none"
        raise AttentionConfigError(
            f"config key(s) {_keys(unused)} belong to no backend in use (backends in use: {names}; their keys: {acc})"
        )


def check_backend_config(raw: dict, backends: Iterable, *, complete: bool = True) -> None:
    """The run's backend config ``raw`` (parsed, :func:`parse_attention_backend_config`) checked
    against ``backends``: each one's own keys through its schema (types, ranges, required keys:
    :func:`validate_backend_config`), then, when ``complete`` (``backends`` are every backend the run
    uses), that each key belongs to one of them (:func:`check_config_keys_used`).  Pipelines run it on
    the backends the settings name before any layer is chosen (a bad value is reported before a dtype
    or platform refusal) and on every backend in use once the layers are bound; ``ditattn backends``
    runs it on the named backends and the platform's automatic choices.  Raises
    :class:`AttentionConfigError`."""
    backends = list(dict.fromkeys(AttentionBackendEnum.from_name(b) for b in backends))
    for b in backends:
        validate_backend_config(b, raw, strict_unknown=False)
    if complete:
        check_config_keys_used(raw, backends)


# ------------------------------------------------------------------------------------------------
# --component-attention-backends


def parse_component_overrides(value: "str | dict | None") -> dict[str, AttentionBackendEnum]:
    """Parse ``text_encoder=torch_sdpa,transformer.cross=fa`` or a JSON object.

    Returns ``{key: backend}`` where a key is a ``model_index.json`` module name optionally
    followed by a role: ``.self``, ``.cross`` (every cross-attention layer) or ``.cross_image``
    (the image cross-attention of an image-to-video DiT).
    """
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            data = loads_json(text, "--component-attention-backends")
            if not isinstance(data, dict):
                raise AttentionConfigError("--component-attention-backends JSON must be an object")
        else:
            data = {}
            for piece in text.split(","):
                if not piece.strip():
                    continue
                if "=" not in piece:
                    raise AttentionConfigError(
                        f"cannot parse component override {short_repr(piece)}: expected component=backend "
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
        if not comp or (dot and role not in ROLES):
            raise AttentionConfigError(
                f"bad component override key {short_repr(key)}: use a model_index.json module name, optionally "
                f"with a role suffix {', '.join('.' + r for r in ROLES)} (e.g. transformer.cross)"
            )
        out[key] = AttentionBackendEnum.from_name(name)
    return out


def component_override_for(
    overrides: dict[str, AttentionBackendEnum], component: str, role: str
) -> tuple[AttentionBackendEnum, str, str] | None:
    """The override that applies to ``component``/``role``: ``(backend, key, source)``.

    A role key beats the component key (for an image cross-attention layer ``.cross_image`` beats
    ``.cross``, which covers every cross-attention layer); ``transformer_2`` (any ``X_2``) inherits
    ``X``'s keys for a role unless it has a key of its own that covers that role (``X_2.<role>`` or
    ``X_2``), so ``transformer=A,transformer_2.cross=B`` gives ``transformer_2`` self-attention ``A``.
    """
    chain = [component] + ([component[:-2]] if component.endswith("_2") else [])
    for comp in chain:
        for r in role_chain(role):
            if f"{comp}.{r}" in overrides:
                return overrides[f"{comp}.{r}"], f"{comp}.{r}", "component_role"
        if comp in overrides:
            return overrides[comp], comp, "component"
    return None
