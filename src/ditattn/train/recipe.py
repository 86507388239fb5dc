"""What ``ditattn:shapes`` is made of and how each stage trains: the presets.

A :class:`Recipe` holds the component configurations (the kwargs of transformers'
``UMT5Config`` and diffusers' ``WanTransformer3DModel`` / ``AutoencoderKLWan`` /
``UniPCMultistepScheduler``), the sampling defaults written next to the weights, and the two
stages' training settings.  Presets:

- ``full``: the shipped model, trained on one H200 (``docs/shapes.md`` has the FLOP estimate):
  DiT 6 blocks x 2 heads x head dim 128 (inner dim 256, ffn 512, ~5.4 M parameters), UMT5 2
  layers x d_model 128, VAE base dim 16 with channel multipliers 1-2-2-2 (8x spatial, 4x temporal,
  16 latent channels).  The DiT trains on several sizes from 64x64x9 to 256x256x33.
- ``cpu``: the same model, trained on one CPU thread at small sizes (64-128 px, 9-17 frames).
- ``tiny``: a toy of every component for smoke tests (a few seconds on a CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ditattn.models.local import BYTE_VOCAB_SIZE
from ditattn.train.scenes import SHAPES

SCHEDULER = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    solver_order=2,
    solver_type="bh2",
    predict_x0=True,
    lower_order_final=True,
    final_sigmas_type="zero",
)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One training size: ``height x width`` pixels, ``frames`` frames, sampled with ``weight``."""

    height: int
    width: int
    frames: int
    weight: float = 1.0

    def tokens(self, spatial: int = 8, temporal: int = 4, patch: int = 2) -> int:
        """DiT tokens of one clip (latent grid / patch)."""
        return (
            ((self.frames - 1) // temporal + 1) * (self.height // spatial // patch) * (self.width // spatial // patch)
        )


@dataclasses.dataclass
class VaeStage:
    """VAE training: clips of one of ``frames`` frames (two shapes with probability ``p_two``)
    rendered at one of ``render_sizes`` and cropped to ``crop x crop`` around a shape; ``batch``
    clips of ``frames[0]`` frames per step (longer clips: proportionally fewer, so every step holds
    about the same number of pixels); loss = L1 + MSE (shape pixels weigh ``1 + fg_weight``, pixels
    on a shape's outline ``edge_weight`` more) + ``kl_weight`` * KL; AdamW at ``lr`` after
    ``warmup`` steps (``resume_warmup`` when continuing from saved weights: the optimizer state is
    not saved)."""

    batch: int
    frames: tuple = (9,)
    p_two: float = 0.7
    render_sizes: tuple = (64, 128, 256)
    crop: int = 64
    lr: float = 5e-4
    kl_weight: float = 1e-6
    fg_weight: float = 4.0
    edge_weight: float = 0.0
    warmup: int = 100
    resume_warmup: int = 50

    def batch_for(self, frames: int) -> int:
        """Clips per step at ``frames`` frames."""
        return max(1, self.batch * self.frames[0] // frames)


@dataclasses.dataclass
class DitStage:
    """DiT training (flow matching as Wan): each step picks a bucket (by weight) and a batch of
    ``batch_tokens // tokens-per-clip`` clips (at most ``max_batch``); latents come from a pool
    per bucket where each step encodes ``1 / reuse`` of a batch afresh (``reuse = 1``: every clip
    new); captions are dropped with ``caption_dropout`` (classifier-free guidance); sigmas are
    uniform ``u`` shifted by ``sigma_shift`` (None: the scheduler's ``flow_shift``; 1: uniform, more
    low-noise steps, where outlines are drawn); ``shape_weights``: the odds of circle, square,
    triangle in the rendered clips (None: equal); ``p_two``: the share of clips with two shapes; AdamW at
    ``lr`` (text encoder: ``text_lr``; 0 = frozen) after a linear warm-up of ``warmup`` steps (``resume_warmup`` when
    continuing from saved weights, whose optimizer state is not saved), then constant until the last
    ``decay_frac`` of the budget, over which it falls linearly to ``final_lr_frac`` x (a
    warm-up / stable / decay schedule: the stable phase can be continued, the decay anneals the
    weights a run ships); EMA ``ema_decay``; ``fg_weight > 0``: latent positions under a shape weigh
    ``1 + fg_weight`` in the loss (normalised by the mean weight)."""

    buckets: tuple
    batch_tokens: int
    max_batch: int = 512
    reuse: int = 8
    pool_batches: int = 16
    caption_dropout: float = 0.1
    lr: float = 4e-4
    text_lr: float = 4e-4
    weight_decay: float = 0.01
    warmup: int = 200
    resume_warmup: int = 100
    decay_frac: float = 0.0
    final_lr_frac: float = 0.1
    ema_decay: float = 0.999
    grad_clip: float = 1.0
    fg_weight: float = 0.0
    sigma_shift: Optional[float] = None
    shape_weights: Optional[tuple] = None
    p_two: float = 0.35

    def lr_factor(self, step: int, progress: float, resumed: bool = False) -> float:
        """The learning-rate multiplier at ``step`` (0-based) when ``progress`` in [0, 1] of the
        budget is spent."""
        warm = min(1.0, (step + 1) / max(1, self.resume_warmup if resumed else self.warmup))
        if self.decay_frac <= 0 or progress <= 1 - self.decay_frac:
            return warm
        into = min(1.0, (progress - (1 - self.decay_frac)) / self.decay_frac)
        return warm * (1 - (1 - self.final_lr_frac) * into)


@dataclasses.dataclass
class Recipe:
    name: str
    text_encoder: dict
    transformer: dict
    vae: dict
    sampling_defaults: dict
    vae_stage: VaeStage
    dit_stage: DitStage
    scheduler: dict = dataclasses.field(default_factory=lambda: dict(SCHEDULER))
    sample_prompts: tuple = (
        "a red circle moving right",
        "a blue square moving up",
        "a yellow triangle growing",
        "a white circle moving left and a green square moving down",
    )

    def with_overrides(self, vae_edge_weight=None, dit_layers=None, **changes) -> "Recipe":
        """A copy whose DiT stage takes the ``changes`` that are not None (``text_lr``, ``buckets``,
        ``fg_weight``, ...), whose VAE stage takes ``vae_edge_weight`` and whose DiT has ``dit_layers``
        blocks, each when not None."""
        changes = {k: v for k, v in changes.items() if v is not None}
        vae = (
            self.vae_stage
            if vae_edge_weight is None
            else dataclasses.replace(self.vae_stage, edge_weight=vae_edge_weight)
        )
        dit = self.transformer if dit_layers is None else dict(self.transformer, num_layers=dit_layers)
        return dataclasses.replace(
            self, transformer=dit, vae_stage=vae, dit_stage=dataclasses.replace(self.dit_stage, **changes)
        )


def _text_encoder(d_model: int, layers: int, heads: int, d_ff: int) -> dict:
    return dict(
        vocab_size=BYTE_VOCAB_SIZE,
        d_model=d_model,
        d_kv=d_model // heads,
        d_ff=d_ff,
        num_layers=layers,
        num_decoder_layers=0,
        num_heads=heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        dropout_rate=0.0,
    )


def _transformer(heads: int, head_dim: int, layers: int, ffn: int, text_dim: int, freq_dim: int) -> dict:
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=text_dim,
        freq_dim=freq_dim,
        ffn_dim=ffn,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def _vae(base: int, mult: list) -> dict:
    return dict(base_dim=base, z_dim=16, dim_mult=mult, num_res_blocks=1, temperal_downsample=[False, True, True])


FULL_BUCKETS = (
    Bucket(64, 64, 9, 1.0),
    Bucket(128, 128, 17, 4.0),
    Bucket(128, 128, 33, 1.0),
    Bucket(192, 192, 17, 1.0),
    Bucket(128, 256, 17, 0.5),
    Bucket(256, 128, 17, 0.5),
    Bucket(256, 256, 33, 2.0),
)
DEFAULTS = dict(height=128, width=128, num_frames=17, num_inference_steps=20, guidance_scale=7.0)

PRESETS = {
    "full": Recipe(
        "full",
        _text_encoder(128, 2, 4, 256),
        _transformer(2, 128, 6, 512, 128, 256),
        _vae(16, [1, 2, 2, 2]),
        dict(DEFAULTS),
        VaeStage(batch=48, frames=(9, 17), render_sizes=(64, 128, 256), crop=128, lr=5e-4),
        DitStage(
            buckets=FULL_BUCKETS,
            batch_tokens=65536,
            max_batch=512,
            reuse=8,
            pool_batches=16,
            ema_decay=0.998,
            decay_frac=0.2,
        ),
    ),
    "cpu": Recipe(
        "cpu",
        _text_encoder(128, 2, 4, 256),
        _transformer(2, 128, 6, 512, 128, 256),
        _vae(16, [1, 2, 2, 2]),
        dict(DEFAULTS),
        VaeStage(batch=8, frames=(9,), render_sizes=(32, 64, 128), crop=32, lr=1e-3, warmup=50),
        DitStage(
            buckets=(Bucket(64, 64, 9, 2.0), Bucket(128, 128, 9, 1.0), Bucket(128, 128, 17, 1.0)),
            batch_tokens=1024,
            max_batch=16,
            reuse=4,
            pool_batches=64,
            warmup=50,
            ema_decay=0.998,
        ),
    ),
    "tiny": Recipe(
        "tiny",
        _text_encoder(32, 1, 2, 64),
        _transformer(2, 16, 1, 64, 32, 32),
        _vae(4, [1, 1, 1, 1]),
        dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0),
        VaeStage(batch=2, frames=(5,), render_sizes=(32,), crop=32, lr=1e-3, warmup=1, resume_warmup=1),
        DitStage(
            buckets=(Bucket(32, 32, 5), Bucket(32, 64, 5)),
            batch_tokens=64,
            max_batch=4,
            reuse=2,
            pool_batches=2,
            warmup=1,
            resume_warmup=1,
            ema_decay=0.9,
        ),
        sample_prompts=("a red circle moving right",),
    ),
}


def recipe(name: str) -> Recipe:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; accepted: {', '.join(PRESETS)}") from None


def parse_buckets(text: str) -> tuple:
    """``"64x64x9:2,128x128x17"`` -> Buckets; sizes must be multiples of 16, frames 1 + 4k."""
    out = []
    for item in text.split(","):
        size, _, weight = item.strip().partition(":")
        try:
            h, w, f = (int(v) for v in size.split("x"))
            wt = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--buckets: bad entry {item!r}; expected HxWxF or HxWxF:weight") from None
        if h <= 0 or w <= 0 or h % 16 or w % 16 or f < 1 or (f - 1) % 4 or wt <= 0:
            raise ValueError(
                f"--buckets: {item!r}: height/width must be positive multiples of 16, frames 1 + 4k, weight positive"
            )
        out.append(Bucket(h, w, f, wt))
    return tuple(out)


def parse_shape_weights(text: str) -> tuple:
    """``"square=2,triangle=1.5"`` -> odds per :data:`~ditattn.train.scenes.SHAPES` entry, ``(1.0, 2.0, 1.5)``
    (shapes left out weigh 1; each >= 0, not all 0)."""
    odds = dict.fromkeys(SHAPES, 1.0)
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        try:
            w = float(value) if sep and name in SHAPES else None
        except ValueError:
            w = None
        if w is None or not w >= 0:
            raise ValueError(
                f"--dit-shape-weights: bad entry {item!r}; expected SHAPE=W with SHAPE one of {', '.join(SHAPES)} "
                "and W >= 0, e.g. square=2"
            )
        odds[name] = w
    if sum(odds.values()) <= 0:
        raise ValueError("--dit-shape-weights: at least one shape needs a weight above 0")
    return tuple(odds[s] for s in SHAPES)
