"""Native UMT5 text encoder, state-dict compatible with transformers' ``UMT5EncoderModel``.

UMT5 adds a learned relative-position bias (one table per layer) to the unscaled attention scores,
so each attention layer is a :class:`~ditattn.attention.layer.LocalAttention` with
``needs_bias=True``, ``scale=1.0`` and the declared default ``torch_sdpa``: only backends that
accept an additive bias can serve it, and an explicit request for one that cannot (``fa``) is
refused by the selector with that reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from ditattn.attention.layer import LocalAttention
from ditattn.models.activations import activation

KEEP_FP32 = ("wo",)  # transformers keeps the feed-forward output projection in float32


@dataclasses.dataclass
class UMT5Config:
    """The fields of a transformers ``UMT5Config`` that the encoder uses (same names/defaults)."""

    vocab_size: int = 250112
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 1024
    num_layers: int = 8
    num_heads: int = 6
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    @classmethod
    def from_dict(cls, data: dict) -> "UMT5Config":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.split("-")[0] == "gated"

    @property
    def dense_act_fn(self) -> str:
        if self.feed_forward_proj == "gated-gelu":
            return "gelu_new"
        return self.feed_forward_proj.split("-")[-1]


class UMT5LayerNorm(nn.Module):
    """T5 RMS norm (no mean, no bias), variance in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def relative_position_buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int, device) -> torch.Tensor:
    """Bidirectional T5 buckets ``[q_len, k_len]`` (long) of ``key_pos - query_pos``.

    Half of the buckets encode the sign; within a half, distances below ``num_buckets // 4`` get a
    bucket each and larger ones share logarithmically wider buckets up to ``max_distance``.
    """
    rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
    half = num_buckets // 2
    out = (rel > 0).long() * half
    dist = rel.abs()
    exact = half // 2
    far = exact + (torch.log(dist.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    far = torch.clamp(far, max=half - 1)
    return out + torch.where(dist < exact, dist, far)


class UMT5SelfAttention(nn.Module):
    """q/k/v/o projections, this layer's relative-position table and the attention layer."""

    def __init__(self, cfg: UMT5Config, idx: int, dtype):
        super().__init__()
        inner = cfg.num_heads * cfg.d_kv
        self.n_heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)
        self.attn = LocalAttention(
            cfg.num_heads,
            cfg.d_kv,
            role="self",
            scale=1.0,
            prefix=f"encoder.block.{idx}.layer.0.SelfAttention",
            layer_idx=idx,
            needs_bias=True,
            default_backend="torch_sdpa",
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.n_heads, self.d_kv)
        k = self.k(x).view(B, S, self.n_heads, self.d_kv)
        v = self.v(x).view(B, S, self.n_heads, self.d_kv)
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0).to(q.dtype)  # [1, H, S, S]
        if keep is not None:
            bias = torch.where(keep[:, None, None, :], bias, torch.finfo(q.dtype).min)
        out = self.attn(q, k, v, attn_bias=bias)
        return self.o(out.reshape(B, S, -1))


class _SelfAttentionLayer(nn.Module):
    def __init__(self, cfg: UMT5Config, idx: int, dtype):
        super().__init__()
        self.SelfAttention = UMT5SelfAttention(cfg, idx, dtype)
        self.layer_norm = UMT5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x, buckets, keep):
        return x + self.SelfAttention(self.layer_norm(x), buckets, keep)


class _Dense(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.gated = cfg.is_gated_act
        if self.gated:
            self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = activation(cfg.dense_act_fn, "UMT5 text encoder")

    def forward(self, x):
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h.to(self.wo.weight.dtype))


class _FFLayer(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.DenseReluDense = _Dense(cfg)
        self.layer_norm = UMT5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x):
        return x + self.DenseReluDense(self.layer_norm(x)).to(x.dtype)


def _clamp_fp16(x):
    if x.dtype == torch.float16:
        big = torch.finfo(torch.float16).max - 1000
        x = torch.clamp(x, min=-big, max=big)
    return x


class _Block(nn.Module):
    def __init__(self, cfg: UMT5Config, idx: int, dtype):
        super().__init__()
        self.layer = nn.ModuleList([_SelfAttentionLayer(cfg, idx, dtype), _FFLayer(cfg)])

    def forward(self, x, buckets, keep):
        x = _clamp_fp16(self.layer[0](x, buckets, keep))
        return _clamp_fp16(self.layer[1](x))


class _Stack(nn.Module):
    def __init__(self, cfg: UMT5Config, dtype):
        super().__init__()
        self.block = nn.ModuleList([_Block(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.final_layer_norm = UMT5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)


class UMT5Encoder(nn.Module):
    """``forward(input_ids [B, S] long, attention_mask [B, S] (1 = token, 0 = padding) | None)
    -> last hidden state [B, S, d_model]``.

    Construct inside ``component_scope("text_encoder")``; weights load unchanged from a transformers
    ``UMT5EncoderModel`` checkpoint (``shared.weight`` / ``encoder.embed_tokens.weight`` are tied).
    """

    def __init__(self, config: UMT5Config, *, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = _Stack(config, dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.shared(input_ids)
        S = input_ids.shape[1]
        buckets = relative_position_buckets(
            S,
            S,
            self.config.relative_attention_num_buckets,
            self.config.relative_attention_max_distance,
            input_ids.device,
        )
        keep = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            keep = attention_mask.bool()
        for block in self.encoder.block:
            x = block(x, buckets, keep)
        return self.encoder.final_layer_norm(x)


def load_umt5_encoder(
    folder: str,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    variant: Optional[str] = None,
    load_weights: bool = True,
) -> UMT5Encoder:
    """Build a :class:`UMT5Encoder` from a transformers ``UMT5EncoderModel`` folder in ``dtype``
    on ``device`` (eval, no gradients); ``load_weights=False`` builds it on the meta device."""
    import os

    from ditattn.models.weights import assign_state_dict, load_state_dict, read_json

    raw = read_json(os.path.join(folder, "config.json"))
    cfg = UMT5Config.from_dict(raw)
    with torch.device("meta"):
        model = UMT5Encoder(cfg, dtype=dtype)
    if load_weights:
        from ditattn.models.weights import target_dtype

        def keep(name: str) -> bool:
            parts = name.split(".")
            return len(parts) > 1 and parts[-2] in KEEP_FP32

        state = load_state_dict(folder, variant, dtype=dtype, keep_fp32=keep)
        assign_state_dict(
            model,
            state,
            where=folder,
            aliases={"encoder.embed_tokens.weight": "shared.weight"},
        )
        for name, p in model.named_parameters():  # tensors the checkpoint stored in another dtype
            want = target_dtype(name, dtype, keep)
            if p.dtype != want:
                p.data = p.data.to(want)
        model.to(device)
    model.eval().requires_grad_(False)
    return model
