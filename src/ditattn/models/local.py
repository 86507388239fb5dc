"""Building the built-in model folders locally: the cache, atomic builds, the byte tokenizer.

A built-in model is an ordinary diffusers-format folder (``model_index.json`` + one folder per
component) written once with diffusers/transformers ``save_pretrained`` into the user cache
(``$DITATTN_CACHE`` or ``~/.cache/ditattn``) and reused afterwards; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Optional

from ditattn.settings import cache_dir


def cached_folder(folder_name: str, build: Callable[[str], None], root: Optional[str] = None) -> str:
    """``<root or cache>/models/<folder_name>``, calling ``build(tmp_dir)`` to write it on first use.

    The build goes to a temporary sibling that is renamed into place, so concurrent processes are
    safe and a failed build leaves nothing behind.
    """
    root = os.path.join(root or cache_dir(), "models")
    target = os.path.join(root, folder_name)
    if os.path.isfile(os.path.join(target, "model_index.json")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "model_index.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (each of the 256 bytes one character)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_VOCAB_SIZE = 259  # pad, eos, unk + 256 bytes


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
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
    )


def save_wan_pipeline(
    out_dir: str,
    *,
    text_encoder,
    transformer,
    vae,
    scheduler,
    transformer_2=None,
    boundary_ratio: Optional[float] = None,
) -> None:
    """Write a diffusers ``WanPipeline`` folder (byte tokenizer) from built components, quietly."""
    from diffusers import WanPipeline

    save_quietly(
        WanPipeline(
            tokenizer=build_byte_tokenizer(),
            text_encoder=text_encoder,
            vae=vae,
            scheduler=scheduler,
            transformer=transformer,
            transformer_2=transformer_2,
            boundary_ratio=boundary_ratio,
        ),
        out_dir,
    )


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
