"""Backend config schemas: the :class:`Param` type (type, default, range, help) and its checks.

Each backend module declares its own parameters next to its implementation
(``backends.base.register(..., schema=(P(...), ...))``); :data:`SCHEMAS` maps a schema key
(``BackendSpec.config_schema``) to those rows, loading the backend modules on first read.  Shared here:
the implementation choices several backends or the kernels check against (``sage_attn``'s ``impl``,
``pv_dtype``, ``qk_dtype``; ``block_sparse_impl`` and ``edge_tiles`` of the block-sparse engine).
Parsing and validation against the schemas: :mod:`ditattn.attention.config`.  ``ditattn backends``
prints them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from ditattn.attention.names import AttentionBackendEnum
from ditattn.attention.specs import SPECS, LazyTable
from ditattn.errors import AttentionConfigError, short_repr


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
                f"{backend}: invalid value {short_repr(value)} for '{self.name}'{extra}; accepted: {acc}"
            )

        t = self.type
        if t == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(" (must be an integer)")
        elif t == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(" (must be a number)")
            try:
                value = float(value)
            except OverflowError:
                raise bad(" (too large)") from None
            if not math.isfinite(value):
                raise bad(" (must be finite)")
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


def in_range(lo, hi, lo_open=False, hi_open=False):
    def check(v):
        ok_lo = v > lo if lo_open else v >= lo
        ok_hi = v < hi if hi_open else v <= hi
        return None if ok_lo and ok_hi else "out of range"

    return check


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def positive(v):
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


def layer_list_check(v):
    try:
        parse_layer_list(v)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def list_len(n, positive=True):
    def check(v):
        if len(v) != n:
            return f"needs exactly {n} integers"
        if positive and any(i <= 0 for i in v):
            return "sizes must be positive"
        return None

    return check


P = Param

# implementation choices (values the backends dispatch on; tests check they match the dispatch tables)
SAGE_IMPLS = ("auto", "sm90", "triton", "package", "reference")
SAGE_K_GRANULARITIES = ("auto", "token", "block")
SAGE_PV_DTYPES = ("fp16", "fp8")
SAGE_PV_ACCUMS = ("two_level", "direct")
SAGE_QK_DTYPES = ("int8", "fp8")
SAGE_QK_IMPLEMENTED = ("int8",)  # Q.K precisions some sage_attn kernel implements
BLOCK_SPARSE_IMPLS = ("auto", "reference", "flex", "triton")
SPARGE_PREDICTORS = ("pooled_query", "pooled_query_var", "pooled")
SOL_PREDICTORS = ("pooled_query", "pooled")
VMOBA_GATES = ("pooled_query", "mean")
SVG2_PREDICTORS = ("pooled_query", "centroids")


# one key shared by every backend on the block-sparse engine (same meaning for all of them)
BLOCK_SPARSE_IMPL = P(
    "block_sparse_impl",
    "str",
    "auto",
    "Kernel of the block-sparse engine: auto (CUDA: FlashAttention-4's block-sparse kernel at 128-token blocks "
    "on SM90/SM100 when flash-attn-4 is installed, else our Triton kernel when the call fits it, else FlexAttention; "
    "CPU: the blocked PyTorch reference), triton (our Triton kernel only; CUDA, or CPU under TRITON_INTERPRET=1), "
    "flex or reference",
    choices=BLOCK_SPARSE_IMPLS,
)

# the pooled top-k / routing backends on the block-sparse engine: how tiles cut by the grid edge are laid out
EDGE_TILES = P(
    "edge_tiles",
    "str",
    "packed",
    "Tiles cut by the grid edge: packed (several such tiles share one block, so the block count approaches "
    "tokens / block size: 513 instead of 624 blocks at 21x30x52 in 4x4x4 tiles) or padded (every tile its own "
    "block, padded to full size)",
    choices=("packed", "padded"),
)


def error_budget(default: float) -> Param:
    """The ``error_budget`` key of a training-free sparse backend (:mod:`ditattn.attention.sparse.budget`)."""
    return P(
        "error_budget",
        "float",
        default,
        "Largest predicted attention mass a query block may drop (0 turns the check off): the selection keeps "
        "more blocks until its estimate meets it, a head that then keeps most blocks runs dense, and a call whose "
        f"heads all do runs the dense kernel; default {default} keeps the output within 5 % relative error on "
        "the structured families (docs/attention.md, error budget)",
        check=in_range(0.0, 1.0, hi_open=True),
        accepted="a number in [0, 1) (0: off)",
    )


def max_rel_err(default: float) -> Param:
    """The ``max_rel_err`` key of a training-free sparse backend (:mod:`ditattn.attention.sparse.check`)."""
    return P(
        "max_rel_err",
        "float",
        default,
        "Largest relative error a sparse call may keep, measured against exact attention on 512 sampled query "
        "rows at the first sparse step of each layer in a request and every 10 steps after: over it, the layer "
        "tries the error budget's wider selection, then runs the dense kernel for the rest of the request "
        "(0 turns the check off; so does error_budget 0)",
        check=in_range(0.0, 1.0, hi_open=True),
        accepted="a number in [0, 1) (0: off)",
    )


def dense_above(default: float) -> Param:
    """The ``dense_above`` key of a budgeted sparse backend: the call-level break-even of the block-sparse path
    (the backends pass :data:`ditattn.attention.sparse.budget.DENSE_CALL_ABOVE`)."""
    return P(
        "dense_above",
        "float",
        default,
        "With the error budget on: a call predicted to keep more than this fraction of its blocks (mean over heads) "
        "runs the dense kernel, decided once per layer and request (H200, Wan 480p: the block-sparse path runs "
        "at 1.28x FlashAttention-4 keeping 0.50 and at 0.47-0.55x keeping 0.66-0.87); 1: only a call that keeps "
        "every block",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1]",
    )


def min_seq_len(cuda_default: int) -> Param:
    """The ``min_seq_len`` key of a training-free sparse backend (unset: the device's figure,
    :data:`ditattn.attention.sparse.fallback.MIN_SEQ_LEN`)."""
    return P(
        "min_seq_len",
        "int",
        None,
        "A call shorter than this many query tokens runs the dense kernel at once (no tiling, no probes), said "
        f"once; unset: {cuda_default} on CUDA, where the sparse path's fixed per-call cost makes it slower below that "
        "(H200: 0.02-0.06x FlashAttention-4 at 2,304 tokens), 0 elsewhere; 0 turns it off",
        check=non_negative,
        accepted="an integer >= 0 (0: off)",
    )


#: schema key -> the parameters of the backends declared with it (each backend module declares its
#: own with ``backends.base.register(..., schema=...)``); loads the backend modules on first read
TABLE: dict[str, tuple[Param, ...]] = {}
SCHEMAS: Mapping[str, tuple[Param, ...]] = LazyTable(TABLE)


def schema_for(backend: AttentionBackendEnum) -> tuple[Param, ...]:
    """The parameters ``backend`` accepts (empty: none)."""
    key = SPECS[backend].config_schema
    return SCHEMAS.get(key, ()) if key else ()
