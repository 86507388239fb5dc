"""The built-in tiny checkpoints ``ditattn:tiny-wan`` and ``ditattn:tiny-wan2.2``.

They are ordinary diffusers-format folders (``model_index.json`` + one folder per component) with
random weights drawn from fixed seeds, written once with diffusers/transformers ``save_pretrained``
into the user cache (``$DITATTN_CACHE`` or ``~/.cache/ditattn``) and reused afterwards; nothing is
downloaded.  Layout (Wan 2.1 text-to-video): ``text_encoder`` (UMT5, 2 layers, d_model 64),
``tokenizer`` (byte-level, built with the ``tokenizers`` library: ids 0/1/2 = pad/eos/unk, then
one id per byte), ``transformer`` (WanTransformer3DModel: 2 blocks, 4 heads x head dim 128, ffn
512), ``vae`` (AutoencoderKLWan, base dim 8: 8x spatial / 4x temporal compression, 16 latent
channels) and ``scheduler`` (UniPC flow-matching, shift 3.0, as the Wan 2.1 checkpoints ship).
``tiny-wan2.2`` adds ``transformer_2`` (the low-noise expert, another seed) and
``boundary_ratio = 0.875`` like Wan2.2-T2V-A14B.  The image-to-video layouts are in
:mod:`ditattn.models.tiny_i2v`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.settings import cache_dir

TINY_MODELS = ("ditattn:tiny-wan", "ditattn:tiny-wan2.2")
DEFAULT_MODEL = "ditattn:tiny-wan"
_VERSION = "v1"  # bump when the recipe changes so stale caches are not reused

TEXT_ENCODER = dict(
    vocab_size=259, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=0, num_heads=4,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0,
)
TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=64, freq_dim=64, ffn_dim=512, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
SCHEDULER = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
    solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero",
)
BOUNDARY_RATIO = 0.875


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (each of the 256 bytes one character)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_tokenizer(model_max_length: int = 512):
    """A byte-level tokenizer (no vocabulary download): pad=0, eos=1 appended, unk=2, byte b -> 3 + b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for b, ch in _bytes_to_unicode().items():
        vocab[ch] = 3 + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        model_max_length=model_max_length, padding_side="right",
    )


def _build(name: str, out_dir: str) -> None:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
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
    pipe = WanPipeline(
        tokenizer=build_byte_tokenizer(), text_encoder=text_encoder, vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER), transformer=transformer, transformer_2=transformer_2,
        boundary_ratio=BOUNDARY_RATIO if transformer_2 is not None else None,
    )
    save_quietly(pipe, out_dir)


def save_quietly(pipe, out_dir: str) -> None:
    """``pipe.save_pretrained(out_dir)`` in safetensors without transformers' progress bar."""
    from transformers.utils import logging as tf_logging

    was_enabled = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()  # a one-off internal build: no "Writing model shards" bar on stderr
    try:
        pipe.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if was_enabled:
            tf_logging.enable_progress_bar()


def tiny_model_path(name: str, root: Optional[str] = None) -> str:
    """The folder of built-in model ``name`` (one of :data:`TINY_MODELS`), building it on first use
    (a few seconds; atomic, so concurrent processes are safe)."""
    if name not in TINY_MODELS:
        raise AttentionConfigError(f"unknown built-in model '{name}'; built-in models: {', '.join(TINY_MODELS)}")
    return cached_build(name, _build, root)


def cached_build(name: str, build, root: Optional[str] = None) -> str:
    """The cache folder of built-in model ``name``, written by ``build(name, folder)`` on first use into
    a temporary folder then renamed (atomic: concurrent processes are safe)."""
    root = os.path.join(root or cache_dir(), "models")
    target = os.path.join(root, f"{name.split(':', 1)[1]}-{_VERSION}")
    if os.path.isfile(os.path.join(target, "model_index.json")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
    try:
        build(name, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "model_index.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target
