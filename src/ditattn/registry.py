"""``list_backends()``: what exists, what runs here and why not — the data of ``ditattn backends``."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ditattn.attention.config import schema_for
from ditattn.attention.names import AttentionBackendEnum, aliases_of
from ditattn.attention.operating_points import OPERATING_POINTS
from ditattn.attention.specs import DTYPE_NAMES, SPECS, LayerRequest
from ditattn.platforms import Platform, current_platform
from ditattn.platforms.policy import substitute


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    name: str
    enum: str
    aliases: tuple[str, ...]
    kind: str
    summary: str
    platforms: tuple[str, ...]  # where ditattn runs it (in-tree CPU reference paths included)
    upstream_platforms: tuple[str, ...]  # where upstream (SGLang) supports it
    lossy: bool
    cross_attention: bool
    returns_lse: bool
    accepts_bias: bool
    drop_in: bool
    dtypes: tuple[str, ...]
    head_dims: Optional[tuple[int, ...]]
    usable_here: bool
    reasons: tuple[str, ...]
    runtime: str
    install_hint: str
    notes: str
    params: tuple[dict, ...]
    substitute_here: Optional[str] = None  # "torch_sdpa: <why>" when the platform runs another backend
    missing_kernel: str = ""
    operating_point: Optional[dict] = None  # measured (error, speed) at the defaults, sparse backends

    @property
    def seed_platforms(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`upstream_platforms` (kept for readers of ``BackendInfo``)."""
        import warnings

        warnings.warn(
            "BackendInfo.seed_platforms is deprecated; use upstream_platforms", DeprecationWarning, stacklevel=2
        )
        return self.upstream_platforms

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def list_backends(platform: Optional[Platform] = None) -> list[BackendInfo]:
    """Every backend with its facts and whether it can run on ``platform`` (default: this machine)."""
    platform = platform or current_platform()
    out = []
    for b in AttentionBackendEnum:
        s = SPECS[b]
        reasons = s.platform_reasons(platform)
        rt = s.runtime_on(platform)
        sub = substitute(b, LayerRequest(dtype=None), platform) if reasons else None
        out.append(
            BackendInfo(
                name=b.value,
                enum=b.name,
                aliases=tuple(aliases_of(b)),
                kind=s.kind,
                summary=s.summary,
                platforms=s.platforms,
                upstream_platforms=s.upstream_platforms,
                lossy=s.lossy,
                cross_attention=s.cross_attention,
                returns_lse=s.returns_lse,
                accepts_bias=s.accepts_bias,
                drop_in=s.drop_in,
                dtypes=tuple(
                    sorted(
                        DTYPE_NAMES[d] for d in (s.cpu_dtypes if platform.name == "cpu" and s.cpu_dtypes else s.dtypes)
                    )
                ),
                head_dims=tuple(sorted(s.head_dims)) if s.head_dims else None,
                usable_here=not reasons,
                reasons=tuple(reasons),
                runtime=rt.label if rt and not reasons else "",
                install_hint=s.install_hint,
                notes=s.notes,
                params=tuple(
                    {
                        "name": p.name,
                        "type": p.type,
                        "default": p.default,
                        "required": p.required,
                        "choices": list(p.choices) if p.choices else None,
                        "help": p.help,
                    }
                    for p in schema_for(b)
                ),
                substitute_here=f"{sub[0].value}: {sub[1]}" if sub else None,
                missing_kernel=s.missing_kernel,
                operating_point=OPERATING_POINTS[b.value].to_json() if b.value in OPERATING_POINTS else None,
            )
        )
    return out
