"""A rough size and time estimate of one generation, from the model's configuration: what a user
learns before a CPU run that would take minutes or hours (``ditattn generate`` warns above
:data:`WARN_SECONDS`; nothing is refused).

The DiT's work per denoising step is counted in multiply-adds of its GEMMs and attention: for ``S``
video tokens, model width ``D = heads x head_dim``, feed-forward width ``F`` and ``L`` blocks, one
forward is about ``L x (4 S^2 D + 12 S D^2 + 4 S D F)`` FLOPs (self-attention scores and values,
the Q/K/V/O and cross-attention Q/O projections, the feed-forward), twice with classifier-free
guidance.  The VAE decoder is counted per output pixel.  The rates are what the default run
(``ditattn:shapes``, 128x128x17, 20 steps) measured on two busy CPU cores: about 40 GFLOP/s for the
DiT and 14 microseconds per decoded pixel; a faster machine finishes sooner, so the figure is an
order of magnitude, not a promise.
"""

from __future__ import annotations

import dataclasses
import math

#: CPU throughput behind the estimate (see the module docstring)
CPU_DIT_FLOPS = 40e9
CPU_DECODE_SECONDS_PER_PIXEL = 14e-6
#: a CPU request estimated above this many seconds gets a warning
WARN_SECONDS = 120.0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """``tokens``: video tokens per DiT forward; ``forwards``: DiT forwards (steps x 2 with guidance);
    ``layers``: DiT blocks; ``dit_flops``: the denoising work; ``seconds``: denoising plus decoding at
    the CPU rates above."""

    tokens: int
    forwards: int
    layers: int
    dit_flops: float
    seconds: float

    def describe(self) -> str:
        return (
            f"{self.tokens} tokens x {self.forwards} DiT forwards x {self.layers} layers (~{_si(self.dit_flops)}FLOP)"
        )


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} "


def estimate(
    *,
    height: int,
    width: int,
    num_frames: int,
    steps: int,
    guidance: bool,
    layers: int,
    heads: int,
    head_dim: int,
    ffn_dim: int,
    patch_size=(1, 2, 2),
    vae_spatial: int = 8,
    vae_temporal: int = 4,
) -> Estimate:
    """The :class:`Estimate` of a ``height x width x num_frames`` generation of ``steps`` steps
    (``guidance``: classifier-free guidance doubles the DiT forwards)."""
    t = (num_frames - 1) // vae_temporal + 1
    pt, ph, pw = patch_size
    s = math.ceil(t / pt) * math.ceil(height / vae_spatial / ph) * math.ceil(width / vae_spatial / pw)
    d = heads * head_dim
    per_forward = layers * (4 * s * s * d + 12 * s * d * d + 4 * s * d * ffn_dim)
    forwards = steps * (2 if guidance else 1)
    flops = float(per_forward) * forwards
    seconds = flops / CPU_DIT_FLOPS + height * width * num_frames * CPU_DECODE_SECONDS_PER_PIXEL
    return Estimate(s, forwards, layers, flops, seconds)


def human_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
