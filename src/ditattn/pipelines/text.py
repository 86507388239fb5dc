"""Prompts of the Wan pipelines: tokenization (the ``tokenizer`` component) and the text features
the DiT cross-attends to (:func:`encode_prompts`).

Tokenization uses the ``tokenizers`` library directly on ``tokenizer/tokenizer.json`` (fast, and
identical to transformers' fast tokenizer built from the same file); folders without
``tokenizer.json`` fall back to ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import html
import logging
import os
import re
import threading
from typing import Sequence

import torch

from ditattn.errors import short_repr
from ditattn.models.weights import read_json

log = logging.getLogger("ditattn.pipelines")


def clean_prompt(text: str) -> str:
    """Unescape HTML entities (twice), collapse whitespace runs, strip (as diffusers' Wan pipeline)."""
    try:
        import ftfy  # a dependency (diffusers' Wan pipelines need it); guarded for a partial install

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _token_text(value) -> "str | None":
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class PromptTokenizer:
    """``__call__(texts, max_length) -> (input_ids [B, max_length] long, mask [B, max_length] long)``:
    special tokens added, truncated and right-padded to ``max_length``."""

    def __init__(self, folder: str):
        self.folder = folder
        path = os.path.join(folder, "tokenizer.json")
        self._fast = None
        self._hf = None
        self._lock = threading.Lock()
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(path)
            pad = None
            for fn in ("tokenizer_config.json", "special_tokens_map.json"):
                p = os.path.join(folder, fn)
                if os.path.isfile(p):
                    pad = _token_text(read_json(p).get("pad_token"))
                    if pad:
                        break
            pad_id = self._fast.token_to_id(pad) if pad else None
            self._pad_token = pad or "<pad>"
            self._pad_id = 0 if pad_id is None else pad_id
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(folder)

    def __call__(self, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [clean_prompt(t) for t in texts]
        if self._hf is not None:
            enc = self._hf(
                list(texts),
                padding="max_length",
                max_length=max_length,
                truncation=True,
                add_special_tokens=True,
                return_attention_mask=True,
                return_tensors="pt",
            )
            return enc.input_ids.long(), enc.attention_mask.long()
        tok = self._fast
        with self._lock:  # truncation/padding settings live on the shared tokenizer
            tok.enable_truncation(max_length=max_length)
            tok.enable_padding(length=max_length, pad_id=self._pad_id, pad_token=self._pad_token, direction="right")
            encs = tok.encode_batch(list(texts), add_special_tokens=True)
        ids = torch.tensor([e.ids for e in encs], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.long)
        return ids, mask


def encode_prompts(
    tokenizer, text_encoder, texts: Sequence[str], max_length: int, device: torch.device
) -> torch.Tensor:
    """Text features ``[len(texts), max_length, dim]`` of ``texts``: tokenized (truncated, padded to
    ``max_length``) and encoded on ``device`` by ``text_encoder(ids, mask)``.  Padding keys are masked
    out, so the encoder runs only up to the longest prompt (same features for the real tokens) and
    the padding rows are zeros, as diffusers pads them."""
    ids, mask = tokenizer(texts, max_length)
    lens = mask.sum(dim=1).tolist()
    for text, n in zip(texts, lens):
        if n >= max_length:  # every position used: the tokenizer cut the rest
            log.warning(
                "a prompt of %d characters fills the text encoder's %d tokens: the rest of it is cut (%s)",
                len(text),
                max_length,
                short_repr(text, 50),
            )
    L_max = max(1, int(max(lens)))
    emb = text_encoder(ids[:, :L_max].to(device), mask[:, :L_max].to(device))
    context = emb.new_zeros(emb.shape[0], ids.shape[1], emb.shape[2])
    for i, L in enumerate(lens):
        context[i, :L] = emb[i, :L]
    return context
