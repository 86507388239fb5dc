"""Backend names: the enum, CLI aliases and case-folding."""

from __future__ import annotations

import enum

from ditattn.errors import AttentionConfigError


class AttentionBackendEnum(enum.Enum):
    """Every attention backend ditattn knows. ``value`` is the lower-case CLI name."""

    FA = "fa"
    TORCH_SDPA = "torch_sdpa"
    TORCH_CUDNN_SDPA = "torch_cudnn_sdpa"
    SLIDING_TILE_ATTN = "sliding_tile_attn"
    SAGE_ATTN = "sage_attn"
    SAGE_ATTN_3 = "sage_attn_3"
    SPARGE_ATTN = "sparge_attn"
    SOL_ATTN = "sol_attn"
    VIDEO_SPARSE_ATTN = "video_sparse_attn"
    SUBBLOCK_SPARSE_ATTN = "subblock_sparse_attn"
    VIDEO_SPARSE_ATTN_H3 = "video_sparse_attn_h3"
    HYBRID_WINDOW_ATTN_H3 = "hybrid_window_attn_h3"
    VMOBA_ATTN = "vmoba_attn"
    AITER = "aiter"
    AITER_SAGE = "aiter_sage"
    SLA_ATTN = "sla_attn"
    SAGE_SLA_ATTN = "sage_sla_attn"
    SPARSE_VIDEO_GEN_2_ATTN = "sparse_video_gen_2_attn"
    LASER_ATTN = "laser_attn"
    BLOCK_SPARSE_ATTN = "block_sparse_attn"
    RAIN_FUSION_ATTN = "rain_fusion_attn"
    FP8_FA_SM120 = "fp8_fa_sm120"

    @classmethod
    def from_name(cls, name: "str | AttentionBackendEnum") -> "AttentionBackendEnum":
        """Resolve a CLI name, enum name or alias (case-insensitive) to a member.

        Raises :class:`AttentionConfigError` listing the valid names when ``name`` is unknown.
        """
        if isinstance(name, cls):
            return name
        if not isinstance(name, str):
            raise AttentionConfigError(
                f"attention backend must be a string, got {type(name).__name__}; "
                f"valid names: {', '.join(valid_names())}"
            )
        key = name.strip().lower().replace("-", "_")
        key = ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise AttentionConfigError(
                f"unknown attention backend '{name if len(name) <= 64 else name[:40] + '...'}'; "
                f"valid names: {', '.join(valid_names())} "
                f"(aliases: {', '.join(f'{a}->{t}' for a, t in ALIASES.items())})"
            ) from None


ALIASES: dict[str, str] = {
    "fa3": "fa",
    "fa4": "fa",
    "cudnn_sdpa": "torch_cudnn_sdpa",
}


def valid_names() -> list[str]:
    return [m.value for m in AttentionBackendEnum]


def aliases_of(backend: AttentionBackendEnum) -> list[str]:
    return [a for a, t in ALIASES.items() if t == backend.value]


# ------------------------------------------------------------------------------------------------
# attention roles

#: What an attention layer attends to: ``self`` (its own tokens), ``cross`` (the text tokens) and
#: ``cross_image`` (the image tokens of an image-to-video DiT: Wan 2.1 I2V's added image K/V).
ROLES = ("self", "cross", "cross_image")
#: Roles whose keys come from another sequence (sparse video backends cannot serve them).
CROSS_ROLES = ("cross", "cross_image")
#: The DiT components of a Wan pipeline (``transformer_2``: Wan 2.2's low-noise expert); their
#: attention is the request-scoped one (overrides, skip softmax), and LoRAs load into them.
DIT_COMPONENTS = ("transformer", "transformer_2")


def role_chain(role: str) -> tuple[str, ...]:
    """The override keys that may cover a layer of ``role``, most specific first: a
    ``cross_image`` layer takes a ``.cross_image`` key, else a ``.cross`` key (all cross-attention)."""
    return ("cross_image", "cross") if role == "cross_image" else (role,)
