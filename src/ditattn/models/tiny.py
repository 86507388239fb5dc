"""The built-in tiny checkpoints ``ditattn:tiny-wan`` and ``ditattn:tiny-wan2.2``.

They are diffusers-format folders with random weights drawn from fixed seeds, built on first use
into the user cache (:mod:`ditattn.models.local`); nothing is downloaded.  Their videos are noise:
they exist for fast tests.  Layout (Wan 2.1 text-to-video): ``text_encoder`` (UMT5, 2 layers,
d_model 64), ``tokenizer`` (byte-level, built with the ``tokenizers`` library: ids 0/1/2 = pad/eos/unk, then
one id per byte), ``transformer`` (WanTransformer3DModel: 2 blocks, 4 heads x head dim 128, ffn
512), ``vae`` (AutoencoderKLWan, base dim 8: 8x spatial / 4x temporal compression, 16 latent
channels) and ``scheduler`` (UniPC flow-matching, shift 3.0, as the Wan 2.1 checkpoints ship).
``tiny-wan2.2`` adds ``transformer_2`` (the low-noise expert, another seed) and
``boundary_ratio = 0.875`` like Wan2.2-T2V-A14B.  The image-to-video layouts are in
:mod:`ditattn.models.tiny_i2v`.
"""

from __future__ import annotations

from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.models.local import build_byte_tokenizer, cached_folder, save_wan_pipeline  # noqa: F401 (re-export)

TINY_MODELS = ("ditattn:tiny-wan", "ditattn:tiny-wan2.2")
_VERSION = "v1"  # bump when the recipe changes so stale caches are not reused

TEXT_ENCODER = dict(
    vocab_size=259,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_decoder_layers=0,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    dropout_rate=0.0,
)
TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=64,
    ffn_dim=512,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
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
BOUNDARY_RATIO = 0.875


def _build(name: str, out_dir: str) -> None:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        text_encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER)).eval()
        torch.manual_seed(2)
        transformer = WanTransformer3DModel(**TRANSFORMER).eval()
        torch.manual_seed(3)
        vae = AutoencoderKLWan(**VAE).eval()
        transformer_2 = None
        if name == "ditattn:tiny-wan2.2":
            torch.manual_seed(4)
            transformer_2 = WanTransformer3DModel(**TRANSFORMER).eval()
    save_wan_pipeline(
        out_dir,
        text_encoder=text_encoder,
        transformer=transformer,
        transformer_2=transformer_2,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        boundary_ratio=BOUNDARY_RATIO if transformer_2 is not None else None,
    )


def tiny_model_path(name: str, root: Optional[str] = None) -> str:
    """The folder of built-in model ``name`` (one of :data:`TINY_MODELS`), building it on first use
    (a few seconds; atomic, so concurrent processes are safe)."""
    if name not in TINY_MODELS:
        raise AttentionConfigError(f"unknown built-in model '{name}'; built-in models: {', '.join(TINY_MODELS)}")
    return cached_folder(f"{name.split(':', 1)[1]}-{_VERSION}", lambda tmp: _build(name, tmp), root)
