"""Native Wan 2.1 / 2.2 video DiT, state-dict compatible with diffusers' ``WanTransformer3DModel``.

Every attention layer is a :class:`~ditattn.attention.layer.LocalAttention` whose backend the
selector resolves when the model is constructed (inside the component's attention scope):
``blocks.{i}.attn1`` is self-attention over the video tokens (role ``self``, with 3-D RoPE; a
``USPAttention``, which is ``LocalAttention`` on one rank and Ulysses x ring attention under
sequence parallelism, where the model shards the video tokens after patch embedding and gathers
them before the output projection) and ``blocks.{i}.attn2`` is cross-attention from the video
tokens to the text tokens (role ``cross``, local on every rank).  Image-to-video checkpoints (Wan 2.1
I2V: ``image_dim`` / ``added_kv_proj_dim`` in the config) add ``blocks.{i}.attn2.image``: the same
queries attend to the projected CLIP image tokens through their own K/V projections (role
``cross_image``, its own attention layer, so it has its own backend in the plan and takes
``transformer.cross_image=...`` overrides); its output is added to the text cross-attention's.

Tensor layout: the model takes latents ``[batch, channels, frames, height, width]`` and patchifies
them with ``patch_size = (p_t, p_h, p_w)`` into ``T' * H' * W'`` tokens in T-major order, where
``(T', H', W') = (frames // p_t, height // p_h, width // p_w)`` is the latent grid that sparse
backends read from the forward context (``video_shape``).  The configuration is
:mod:`ditattn.models.wan.config`'s, the timestep / text / image embeddings and the rotary tables
:mod:`ditattn.models.wan.embeddings`'.

Precision follows diffusers: the layer norms, the modulation tables and the time embedder compute
in float32 (their parameters stay float32 when the model runs in fp16/bf16).

Speed: the memory-bound work around each attention (gated residual + modulated layer norm, q/k
RMSNorm + RoPE) runs as single-pass fused kernels from :mod:`ditattn.models.fused` (Triton on CUDA,
the PyTorch reference elsewhere), and on CUDA the feed-forward's tanh-GELU runs in the epilogue of
its first GEMM (cuBLASLt; with plain weights only: a linear quantized by
:mod:`ditattn.models.quantization` runs its own 8-bit GEMM and the GELU after it).  FP8 linears
(:mod:`ditattn.models.fp8_linear`) quantize each distinct input once in one fused pass (the
self-attention q/k/v share one) and the feed-forward's GELU moves into the quantizer of its second
GEMM.  The fused norm kernels read only norm weights, never a linear's, so they run unchanged under
quantization.
``WanTransformer.set_fused_ops(False)`` switches all of it back to the
plain PyTorch ops (same numbers up to rounding; for comparisons).

Step caching: when the request has a step cache (:func:`ditattn.cache.current_cache`), the block stack
runs through it, which computes it, or part of it, or reuses the cached residual (:mod:`ditattn.cache`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ditattn.attention.context import forward_context
from ditattn.attention.layer import LocalAttention
from ditattn.cache.runtime import current_cache
from ditattn.distributed.attention import USPAttention
from ditattn.distributed.comm import gather_sequence, shard_sequence
from ditattn.distributed.groups import get_sequence_parallel
from ditattn.models.fp8_linear import fp8_linear, fp8_linears, takes_fused
from ditattn.models.fused import apply_rope, qk_norm_rope, residual_norm
from ditattn.models.quantization import plain_weight
from ditattn.models.wan.config import WanTransformerConfig
from ditattn.models.wan.embeddings import FP32LayerNorm, WanConditionEmbedder, rope_tables

# parameters that stay float32 when the model runs in fp16/bf16 (diffusers' _keep_in_fp32_modules)
KEEP_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


class WanAttention(nn.Module):
    """Projections + q/k RMSNorm (+ RoPE for self-attention) around one ``LocalAttention``; the
    cross-attention of an image-to-video checkpoint (``image=True``) adds the image K/V projections
    (``add_k_proj``, ``add_v_proj``, ``norm_added_k``) and a second layer, ``image_attn`` (role
    ``cross_image``)."""

    def __init__(
        self, cfg: WanTransformerConfig, *, role: str, prefix: str, layer_idx: int, dtype, image: bool = False
    ):
        super().__init__()
        d = cfg.inner_dim
        self.heads = cfg.num_attention_heads
        self.to_q = nn.Linear(d, d)
        self.to_k = nn.Linear(d, d)
        self.to_v = nn.Linear(d, d)
        self.to_out = nn.ModuleList([nn.Linear(d, d), nn.Dropout(0.0)])
        self.norm_q = nn.RMSNorm(d, eps=cfg.eps, elementwise_affine=True)
        self.norm_k = nn.RMSNorm(d, eps=cfg.eps, elementwise_affine=True)
        # self-attention is sequence-parallel (USPAttention == LocalAttention on one rank); cross-attention
        # attends each rank's query shard to the replicated text K/V locally
        self.attn = (USPAttention if role == "self" else LocalAttention)(
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            role=role,
            prefix=prefix,
            layer_idx=layer_idx,
            dtype=dtype,
        )
        self.image_attn = None
        if image:
            self.add_k_proj = nn.Linear(cfg.added_kv_proj_dim, d)
            self.add_v_proj = nn.Linear(cfg.added_kv_proj_dim, d)
            self.norm_added_k = nn.RMSNorm(d, eps=cfg.eps, elementwise_affine=True)
            self.image_attn = LocalAttention(
                cfg.num_attention_heads,
                cfg.attention_head_dim,
                role="cross_image",
                prefix=f"{prefix}.image",
                layer_idx=layer_idx,
                dtype=dtype,
            )

    def project_kv(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed) and V of ``src [B, L, D]`` as ``[B, L, heads, head_dim]``."""
        k = self.norm_k(self.to_k(src)).unflatten(2, (self.heads, -1))
        return k, self.to_v(src).unflatten(2, (self.heads, -1))

    def project_image_kv(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed) and V of the embedded image tokens ``[B, N, D]`` as ``[B, N, heads, head_dim]``."""
        k = self.norm_added_k(self.add_k_proj(image)).unflatten(2, (self.heads, -1))
        return k, self.add_v_proj(image).unflatten(2, (self.heads, -1))

    def forward(
        self,
        x: torch.Tensor,
        context: Optional[torch.Tensor] = None,
        rotary=None,
        kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        fused: str = "auto",
        image_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        image: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``x [B, S, D]`` -> ``[B, S, D]``; cross-attention takes ``context`` or its projected ``kv``,
        and (image-to-video) the embedded image tokens ``image`` or their projected ``image_kv``."""
        if rotary is not None and kv is None and context is None:  # self-attention: one pass for norms + RoPE
            # FP8 linears: x quantized once for the three projections (models/fp8_linear.py)
            q, k, v = fp8_linears(x, (self.to_q, self.to_k, self.to_v), fused)
            q, k = qk_norm_rope(
                q,
                k,
                self.norm_q.weight,
                self.norm_k.weight,
                *rotary,
                eps=self.norm_q.eps,
                head_dim=x.shape[-1] // self.heads,
                impl=fused,
            )
            q, k, v = (
                q.unflatten(2, (self.heads, -1)),
                k.unflatten(2, (self.heads, -1)),
                v.unflatten(2, (self.heads, -1)),
            )
        else:
            q = self.norm_q(fp8_linear(x, self.to_q, fused)).unflatten(2, (self.heads, -1))
            k, v = kv if kv is not None else self.project_kv(x if context is None else context)
            if rotary is not None:
                q, k = apply_rope(q, *rotary), apply_rope(k, *rotary)
        out = self.attn(q, k, v).flatten(2, 3).type_as(q)
        if self.image_attn is not None:
            if image_kv is None:
                if image is None:
                    raise ValueError(
                        "this image-to-video transformer needs the image tokens (encoder_hidden_states_image)"
                    )
                image_kv = self.project_image_kv(image)
            out = out + self.image_attn(q, *image_kv).flatten(2, 3).type_as(q)
        return fp8_linear(out, self.to_out[0], fused)


class _GeluProj(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def gelu_epilogue(self, on_cuda: bool, fused: str = "auto") -> bool:
        """Whether the tanh-GELU runs in the cuBLASLt epilogue of this GEMM: on CUDA, with a bias
        and a plain weight; a quantized weight (``--dit-quantization``) runs its own 8-bit GEMM
        through the module and the GELU after it."""
        return fused != "torch" and on_cuda and self.proj.bias is not None and plain_weight(self.proj)

    def forward(self, x, fused: str = "auto"):
        if self.gelu_epilogue(x.is_cuda, fused):
            # GEMM + bias + tanh-GELU in one cuBLASLt call (the activation in the GEMM epilogue)
            y = torch._addmm_activation(
                self.proj.bias, x.reshape(-1, x.shape[-1]), self.proj.weight.t(), use_gelu=True
            )
            return y.view(*x.shape[:-1], -1)
        return F.gelu(self.proj(x), approximate="tanh")


class WanFeedForward(nn.Module):
    """``net.0.proj`` -> tanh-GELU -> ``net.2`` (diffusers' FeedForward key layout).  With FP8
    linears on the fused path the first GEMM writes its bias-added output and the GELU runs in the
    quantizer of the second GEMM's input (one pass: GELU, absmax, scale, cast)."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, inner), nn.Dropout(0.0), nn.Linear(inner, dim)])

    def forward(self, x, fused: str = "auto"):
        fc1 = self.net[0].proj
        if not takes_fused(fc1, fused):  # plain (GELU epilogue on CUDA) or torchao's path, GELU included
            return fp8_linear(self.net[0](x, fused), self.net[2], fused)
        return fp8_linear(fp8_linear(x, fc1, fused), self.net[2], fused, gelu=True)


class WanBlock(nn.Module):
    """Modulated self-attention, cross-attention to text, modulated feed-forward."""

    def __init__(self, cfg: WanTransformerConfig, idx: int, dtype):
        super().__init__()
        d = cfg.inner_dim
        self.norm1 = FP32LayerNorm(d, cfg.eps, elementwise_affine=False)
        self.attn1 = WanAttention(cfg, role="self", prefix=f"blocks.{idx}.attn1", layer_idx=idx, dtype=dtype)
        self.attn2 = WanAttention(
            cfg, role="cross", prefix=f"blocks.{idx}.attn2", layer_idx=idx, dtype=dtype, image=cfg.has_image_input
        )
        self.norm2 = FP32LayerNorm(d, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = WanFeedForward(d, cfg.ffn_dim)
        self.norm3 = FP32LayerNorm(d, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        #: "auto" (fused kernels where they run), "torch" (plain PyTorch ops): WanTransformer.set_fused_ops
        self.fused = "auto"

    def _mods(self, tproj):
        if tproj.ndim == 4:  # per-token timesteps (Wan 2.2 TI2V): [B, S, 6, D]
            mods = (self.scale_shift_table.unsqueeze(0) + tproj.float()).chunk(6, dim=2)
            return [m.squeeze(2) for m in mods]
        return (self.scale_shift_table + tproj.float()).chunk(6, dim=1)  # [B, 6, D]

    def modulated_input(self, x, tproj):
        """The timestep-modulated input of the self-attention, ``norm1(x) * (1 + scale1) + shift1``
        ``[B, S, D]`` (what a step cache compares between steps)."""
        shift1, scale1 = self._mods(tproj)[:2]
        return residual_norm(x, scale=scale1, shift=shift1, eps=self.norm1.eps, impl=self.fused)[1]

    def forward(self, x, context, tproj, rotary, kv=None, image_kv=None, image=None):
        shift1, scale1, gate1, shift2, scale2, gate2 = self._mods(tproj)
        f, eps = self.fused, self.norm1.eps
        # x' = x + branch * gate and the next modulated norm of x', one pass each (models/fused.py)
        _, h = residual_norm(x, scale=scale1, shift=shift1, eps=eps, impl=f)
        y = self.attn1(h, None, rotary, fused=f)
        if isinstance(self.norm2, nn.LayerNorm):
            x, h = residual_norm(
                x, y, gate1, weight=self.norm2.weight, bias=self.norm2.bias, eps=self.norm2.eps, impl=f
            )
        else:  # no cross-attention norm
            x, _ = residual_norm(x, y, gate1, norm=False, impl=f)
            h = x
        x, h = residual_norm(
            x,
            self.attn2(h, context, kv=kv, fused=f, image_kv=image_kv, image=image),
            None,
            scale=scale2,
            shift=shift2,
            eps=self.norm3.eps,
            impl=f,
        )
        x, _ = residual_norm(x, self.ffn(h, f), gate2, norm=False, impl=f)
        return x


class WanTransformer(nn.Module):
    """The Wan DiT: ``forward(latents [B, C, F, H, W], timestep [B] | [B, S], text [B, L, text_dim])
    -> prediction [B, out_channels, F, H, W]``.

    Construct it inside ``component_scope("transformer")`` (and the run's ``attention_settings``)
    so its attention layers resolve their backends; ``dtype`` is the compute dtype the layers are
    checked for.  Weights load unchanged from a diffusers ``WanTransformer3DModel`` checkpoint.
    """

    def __init__(self, config: WanTransformerConfig, *, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.config = config
        d = config.inner_dim
        self.patch_embedding = nn.Conv3d(
            config.in_channels, d, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.condition_embedder = WanConditionEmbedder(config)
        self.blocks = nn.ModuleList([WanBlock(config, i, dtype) for i in range(config.num_layers)])
        self.norm_out = FP32LayerNorm(d, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(d, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self._rope_cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fused = "auto"  # the output norm's impl; see set_fused_ops

    def set_fused_ops(self, enabled: bool) -> "WanTransformer":
        """Use the fused kernels of :mod:`ditattn.models.fused` (default) or plain PyTorch ops."""
        self.fused = "auto" if enabled else "torch"
        for block in self.blocks:
            block.fused = self.fused
        return self

    def latent_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The token grid ``(T', H', W')`` of latents with that many frames / rows / columns."""
        pt, ph, pw = self.config.patch_size
        return frames // pt, height // ph, width // pw

    def rotary(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, str(device))
        tab = self._rope_cache.get(key)
        if tab is None:
            tab = rope_tables(self.config.attention_head_dim, grid, device)
            if len(self._rope_cache) > 16:
                self._rope_cache.clear()
            self._rope_cache[key] = tab
        return tab

    def encode_text(
        self,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: Optional[torch.Tensor] = None,
        *,
        per_block: bool = True,
    ) -> "WanTextCache":
        """Precompute the conditioning side of every step: the projected text ``[B, L, D]`` (and, for
        image-to-video checkpoints, the embedded CLIP image tokens ``[B, N, image_dim] -> [B, N, D]``)
        and, with ``per_block``, each block's cross-attention K/V.  They do not depend on the latents
        or the timestep, so a denoise loop computes them once and passes ``text_cache=`` to every
        step (same numbers, less work).  ``per_block=False`` leaves the K/V to each block's forward
        (for block-streaming offload, where a block's weights are on the device only while it runs)."""
        context = self.condition_embedder.text_embedder(encoder_hidden_states)
        image = None
        if self.config.has_image_input:
            if encoder_hidden_states_image is None:
                raise ValueError("this image-to-video transformer (image_dim set) needs encoder_hidden_states_image")
            image = self.condition_embedder.image_embedder(encoder_hidden_states_image)
        kv = image_kv = None
        if per_block:
            kv = [block.attn2.project_kv(context) for block in self.blocks]
            if image is not None:
                image_kv = [block.attn2.project_image_kv(image) for block in self.blocks]
        return WanTextCache(context, kv, encoder_hidden_states.dtype, image, image_kv)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        encoder_hidden_states_image: Optional[torch.Tensor] = None,
        *,
        text_cache: "Optional[WanTextCache]" = None,
    ):
        """latents ``[B, C, F, H, W]``, timestep ``[B]`` (or ``[B, S]`` per token), text
        ``[B, L, text_dim]`` and, for image-to-video checkpoints, CLIP image tokens
        ``[B, N, image_dim]`` (or a :meth:`encode_text` cache of both) -> ``[B, out_channels, F, H, W]``."""
        if text_cache is None:
            if encoder_hidden_states is None:
                raise ValueError("WanTransformer.forward needs encoder_hidden_states or text_cache")
            text_cache = self.encode_text(encoder_hidden_states, encoder_hidden_states_image)
        B, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.config.patch_size
        grid = self.latent_grid(frames, height, width)
        rotary = self.rotary(grid, hidden_states.device)

        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        ts_len = None
        if timestep.ndim == 2:
            ts_len = timestep.shape[1]
            timestep = timestep.flatten()
        temb, tproj = self.condition_embedder.time(timestep, text_cache.dtype, ts_len)
        context = text_cache.context
        tproj = tproj.unflatten(2, (6, -1)) if ts_len is not None else tproj.unflatten(1, (6, -1))

        with forward_context(video_shape=grid, text_len=0):
            # sequence parallelism: each rank runs the blocks on its chunk of the video tokens (identity on one rank)
            seq_len = x.shape[1]
            x, rotary = shard_sequence(x), tuple(shard_sequence(t) for t in rotary)
            tproj = shard_sequence(tproj) if tproj.ndim == 4 else tproj
            c = text_cache

            def run(a: int, b: int, h: torch.Tensor) -> torch.Tensor:  # blocks [a, b) on h
                for i in range(a, b):
                    h = self.blocks[i](
                        h,
                        context,
                        tproj,
                        rotary,
                        c.kv[i] if c.kv else None,
                        c.image_kv[i] if c.image_kv else None,
                        c.image,
                    )
                return h

            cache = current_cache()  # the request's step cache (ditattn.cache), or None
            if cache is None:
                x = run(0, len(self.blocks), x)
            else:
                x0 = x
                x = cache.forward_blocks(
                    self,
                    x0,
                    run,
                    len(self.blocks),
                    lambda: self.blocks[0].modulated_input(x0, tproj),
                    valid_rows(seq_len, x0.shape[1]),
                )
            x = gather_sequence(x, seq_len)

        if temb.ndim == 3:
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        _, x = residual_norm(x, scale=scale, shift=shift, eps=self.norm_out.eps, impl=self.fused)
        x = self.proj_out(x)
        T, H, W = grid
        x = x.reshape(B, T, H, W, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def valid_rows(seq_len: int, local: int) -> int:
    """Rows of this rank's ``local``-row shard of a ``seq_len``-token sequence that are tokens (the rest
    is the padding :func:`~ditattn.distributed.comm.shard_sequence` adds on the last ranks)."""
    groups = get_sequence_parallel()
    if groups is None or groups.world_size == 1:
        return local
    return max(0, min(local, seq_len - groups.rank * local))


@dataclasses.dataclass
class WanTextCache:
    """The conditioning side of a denoise loop (:meth:`WanTransformer.encode_text`): ``context`` the
    projected text ``[B, L, D]``, ``kv`` one cross-attention ``(K, V)`` pair ``[B, L, heads, head_dim]``
    per block (None: each block projects ``context`` itself), ``dtype`` of the raw text features (the
    time embedding is cast to it, as diffusers does); image-to-video checkpoints only (else None):
    ``image`` the embedded image tokens ``[B, N, D]`` and ``image_kv`` one image ``(K, V)`` pair
    ``[B, N, heads, head_dim]`` per block (None: each block projects ``image``)."""

    context: torch.Tensor
    kv: Optional[list]
    dtype: torch.dtype
    image: Optional[torch.Tensor] = None
    image_kv: Optional[list] = None


def cast_model(model: nn.Module, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()) -> nn.Module:
    """Cast parameters to ``dtype`` in place, each at most once; in fp16/bf16 the parameters with a
    name part in ``keep_fp32`` become (stay) float32, as diffusers / transformers load them."""
    from ditattn.models.weights import target_dtype

    keep = _keep_fn(keep_fp32)
    for name, p in model.named_parameters():
        want = target_dtype(name, dtype, keep)
        if p.dtype != want:
            p.data = p.data.to(want)
    return model


def _keep_fn(keep_fp32: tuple[str, ...]):
    return lambda name: any(part in keep_fp32 for part in name.split("."))


def load_wan_transformer(
    folder: str,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    variant: Optional[str] = None,
    load_weights: bool = True,
    weights_file: Optional[str] = None,
) -> WanTransformer:
    """Build a :class:`WanTransformer` from a diffusers ``WanTransformer3DModel`` folder
    (``config.json`` + weights) in ``dtype`` on ``device``, in eval mode without gradients.

    Call it inside the component's attention scope.  ``load_weights=False`` builds the model on
    the meta device (no memory, no file reads beyond the config): enough to resolve the attention
    plan.  ``weights_file``: one ``.safetensors`` file to take the weights from instead of the
    folder's (diffusers or original Wan key names, 8-bit with scales too:
    :mod:`ditattn.models.wan.checkpoint`).  8-bit linears are applied afterwards
    (:func:`ditattn.models.quantization.quantize_linears`, after any LoRA is fused).
    """
    import os

    from ditattn.models.wan.checkpoint import is_scale_key, load_weights_file, to_native_state
    from ditattn.models.weights import assign_state_dict, load_state_dict, read_json, target_dtype

    cfg = WanTransformerConfig.from_dict(read_json(os.path.join(folder, "config.json")))
    with torch.device("meta"):
        model = WanTransformer(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    keep = _keep_fn(KEEP_FP32)
    if load_weights:
        if weights_file is None:
            state = load_state_dict(folder, variant, dtype=dtype, keep_fp32=lambda n: keep(n) or is_scale_key(n))
        else:
            state = load_weights_file(weights_file)
        state, report = to_native_state(state, lambda name: target_dtype(name, dtype, keep))
        if weights_file is not None or report.eight_bit:
            logging.getLogger("ditattn.pipeline").info(
                "DiT weights from %s: %s", weights_file or folder, report.describe()
            )
        assign_state_dict(model, state, where=weights_file or folder, ignore_unexpected=("norm_added_q",))
        cast_model(model, dtype, KEEP_FP32).to(device)
    return model
