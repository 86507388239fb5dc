"""Capability facts of every backend, as data, and the check that explains a refusal.

``SPECS[backend].reasons(request, platform)`` returns a list of human-readable reasons why the
backend cannot serve ``request`` on ``platform`` (empty list = usable).  The selector, the CLI
``backends`` table, the per-request override validation and the tests all read these facts; no
other module hard-codes what a backend can do.  Each row is declared next to its implementation
(``ditattn.attention.backends.<module>``); :data:`SPECS` loads them all on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Iterator, Mapping

import torch

from ditattn.attention.names import CROSS_ROLES
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.platforms import Platform

FP16_BF16 = frozenset({torch.float16, torch.bfloat16})
ALL_FLOAT = frozenset({torch.float32, torch.float16, torch.bfloat16})
BF16 = frozenset({torch.bfloat16})
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


@dataclasses.dataclass(frozen=True)
class LayerRequest:
    """What one attention layer (or one call) needs from a backend.

    role: ``"self"``, ``"cross"`` or ``"cross_image"`` (``names.ROLES``). head_dim, dtype: of q/k/v.
    needs_bias: the layer adds a bias
    or mask to the scores. needs_lse: the caller merges partial results (ring attention).
    varlen: packed variable-length sequences. seq_q/seq_kv/batch: known only for a concrete call.
    """

    role: str = "self"
    head_dim: int | None = None
    dtype: torch.dtype | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    causal: bool = False
    needs_bias: bool = False
    needs_lse: bool = False
    varlen: bool = False
    seq_q: int | None = None
    seq_kv: int | None = None
    batch: int | None = None


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How a backend runs on one platform: alternative import names (empty = in-tree/built in).

    missing: non-empty when upstream (SGLang) names this runtime but this build has no kernel path for it
    (the reason); such a runtime never counts as available, so the backend is refused or, where
    upstream allows it, substituted (``fa`` -> ``torch_sdpa``) with this reason.
    """

    modules: tuple[str, ...] = ()
    label: str = "in-tree"
    missing: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """The capability row of one backend, declared in its module with ``backends.base.register``
    (which fills in ``backend`` and ``config_schema``).  ``extra_check(spec, req, platform)`` adds
    reasons of its own; ``runtime_label(spec, platform, req, config)`` names the runtime the plan
    reports when it depends on the call (``sage_attn``: the implementation its rule picks);
    ``runtime_broken(runtime, platform)`` says why an installed runtime does not work on a platform
    (``sage_attn``: a sageattention release without the SM90 fix on Hopper), so it does not count."""

    backend: B | None = None
    kind: str  # dense | quantized | sparse | sparse+quantized | sparse+linear
    summary: str
    runtimes: Mapping[str, tuple[Runtime, ...]]  # platform name -> alternatives (any one suffices)
    upstream_platforms: tuple[str, ...]  # upstream (SGLang)'s support matrix
    dtypes: frozenset = FP16_BF16
    cpu_dtypes: frozenset | None = None  # dtypes of the CPU reference path, when it differs
    head_dims: frozenset[int] | None = None
    max_head_dim: int | None = 256
    cuda_sm: tuple[int, ...] | None = None  # allowed SM numbers, e.g. (80, 86, 90)
    cuda_sm_min: int | None = None
    lossy: bool = False
    cross_attention: bool = True
    returns_lse: bool = False
    accepts_bias: bool = False
    causal: bool = True
    varlen: bool = False
    drop_in: bool = False
    install_hint: str = ""
    config_schema: str | None = None  # key into config.SCHEMAS
    notes: str = ""
    missing_kernel: str = ""  # non-empty: this build has no kernel for it (the reason)
    extra_check: Callable[["BackendSpec", LayerRequest, Platform], list[str]] | None = None
    runtime_label: Callable[["BackendSpec", Platform, "LayerRequest | None", "Mapping | None"], str] | None = None
    runtime_broken: Callable[[Runtime, Platform], "str | None"] | None = None

    @property
    def name(self) -> str:
        return self.backend.value

    @property
    def sparse(self) -> bool:
        return self.kind.startswith("sparse")

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self.runtimes)

    def broken_reason(self, rt: Runtime, platform: Platform) -> str | None:
        """Why the installed runtime ``rt`` does not work on ``platform`` (None: it does, or it is not
        installed), by the row's ``runtime_broken`` rule."""
        return self.runtime_broken(rt, platform) if self.runtime_broken is not None else None

    def runtime_on(self, platform: Platform) -> Runtime | None:
        """The first installed runtime on ``platform`` that works there, or None."""
        for rt in self.runtimes.get(platform.name, ()):
            if (
                not rt.missing
                and (not rt.modules or platform.has_any(rt.modules))
                and self.broken_reason(rt, platform) is None
            ):
                return rt
        return None

    def runtime_reason(self, platform: Platform) -> str | None:
        """Why no runtime of this backend is available on ``platform`` (None: one is)."""
        if self.runtime_on(platform) is not None:
            return None
        rts = self.runtimes.get(platform.name, ())
        broken = [b for b in (self.broken_reason(rt, platform) for rt in rts) if b]
        if broken:
            return "; ".join(broken)
        if rts and all(rt.missing for rt in rts):
            return "; ".join(rt.missing for rt in rts)
        mods = [m for rt in rts if not rt.missing for m in rt.modules]
        hint = f"; install: {self.install_hint}" if self.install_hint else ""
        return f"needs package {' or '.join(repr(m) for m in mods)} (not installed){hint}"

    def platform_reasons(self, platform: Platform) -> list[str]:
        """Why the backend cannot run on ``platform`` at all (platform, SM, missing package)."""
        if platform.name not in self.runtimes:
            where = ", ".join(self.runtimes) or "no platform in this build"
            return [f"not supported on {platform.name} (runs on: {where})"]
        reasons = []
        if self.missing_kernel:
            reasons.append(self.missing_kernel)
        if platform.name == "cuda" and platform.sm is not None:
            if self.cuda_sm is not None and platform.sm not in self.cuda_sm:
                reasons.append(
                    f"needs CUDA compute capability SM{'/'.join(map(str, self.cuda_sm))}, this GPU is SM{platform.sm}"
                )
            if self.cuda_sm_min is not None and platform.sm < self.cuda_sm_min:
                reasons.append(f"needs CUDA SM{self.cuda_sm_min}+, this GPU is SM{platform.sm}")
        missing = self.runtime_reason(platform)
        if missing is not None and not self.missing_kernel:
            reasons.append(missing)
        return reasons

    def reasons(self, req: LayerRequest, platform: Platform) -> list[str]:
        """Every reason this backend cannot serve ``req`` on ``platform`` (empty = usable)."""
        reasons = self.platform_reasons(platform)
        dtypes = self.cpu_dtypes if platform.name == "cpu" and self.cpu_dtypes else self.dtypes
        if req.dtype is not None and req.dtype not in dtypes:
            reasons.append(
                f"dtype {DTYPE_NAMES.get(req.dtype, req.dtype)} not supported "
                f"(accepts {', '.join(sorted(DTYPE_NAMES[d] for d in dtypes))})"
            )
        if req.head_dim is not None:
            if self.head_dims is not None and req.head_dim not in self.head_dims:
                reasons.append(f"head dim {req.head_dim} not supported (accepts {sorted(self.head_dims)})")
            elif self.max_head_dim is not None and req.head_dim > self.max_head_dim:
                reasons.append(f"head dim {req.head_dim} > {self.max_head_dim}")
        reasons.extend(self.semantic_reasons(req))
        if self.extra_check is not None:
            reasons.extend(self.extra_check(self, req, platform))
        return reasons

    def semantic_reasons(self, req: LayerRequest) -> list[str]:
        """Reasons about what the layer computes (cross-attention, bias, LSE, causal, varlen): a
        platform substitution never overrides these."""
        reasons = []
        if req.role in CROSS_ROLES and not self.cross_attention:
            reasons.append("cannot serve cross-attention (sparse video attention needs self-attention)")
        if req.needs_bias and not self.accepts_bias:
            reasons.append("does not accept an additive attention bias/mask, which this layer needs")
        if req.needs_lse and not self.returns_lse:
            reasons.append("does not return the softmax LSE that ring attention needs")
        if req.causal and not self.causal:
            reasons.append("does not support causal attention")
        if req.varlen and not self.varlen:
            reasons.append("does not support packed variable-length attention")
        return reasons


#: runtimes of the in-tree backends: no package needed on any platform (``torch_sdpa``) / the
#: in-tree sparse engine (Triton or FlexAttention on CUDA, the PyTorch reference on the CPU)
NO_PACKAGE = (Runtime(),)
IN_TREE_SPARSE = {
    "cuda": (Runtime((), "in-tree Triton/FlexAttention"),),
    "cpu": (Runtime((), "in-tree PyTorch reference"),),
}

#: the rows declared so far (``backends.base.declare`` fills it); read it through :data:`SPECS`
TABLE: dict[B, BackendSpec] = {}
_BACKENDS_PACKAGE = "ditattn.attention.backends"


def load_backends() -> None:
    """Import every backend module (once), so that each has declared its row, schema and
    implementation.  Raises ``AssertionError`` naming the backends without a row."""
    if len(TABLE) == len(B):
        return
    importlib.import_module(_BACKENDS_PACKAGE)  # a string: the tables sit below the modules that fill them
    missing = [b.value for b in B if b not in TABLE]
    assert not missing, f"attention backends without a declaration in {_BACKENDS_PACKAGE}: {', '.join(missing)}"


class LazyTable(Mapping):
    """A read-only view of a table the backend modules fill, loading them on first read."""

    def __init__(self, table: dict):
        self._table = table

    def __getitem__(self, key):
        load_backends()
        return self._table[key]

    def __iter__(self) -> Iterator:
        load_backends()
        return iter(self._table)

    def __len__(self) -> int:
        load_backends()
        return len(self._table)

    def __repr__(self) -> str:
        return f"LazyTable({dict(self)!r})"


#: backend -> its capability row, for every member of the enum
SPECS: Mapping[B, BackendSpec] = LazyTable(TABLE)


def get_spec(backend) -> BackendSpec:
    return SPECS[B.from_name(backend)]
