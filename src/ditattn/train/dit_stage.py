"""Stage 2: the Wan DiT (and the UMT5 text encoder, unless frozen) with flow matching.

Trains diffusers' ``WanTransformer3DModel`` (plain PyTorch, so autograd works; ditattn's native
model runs fused kernels without a backward) on latents of the frozen stage-1 VAE:

- sizes: each step draws a :class:`~ditattn.train.recipe.Bucket` by weight and fills a batch of
  about ``batch_tokens`` DiT tokens;
- latents: a ring pool per bucket; each step renders and encodes ``batch / reuse`` new clips into
  it (the first visit fills a whole batch, in chunks of that same size: one encoder shape per
  bucket) and trains on a random batch drawn from the pool;
- text: captions are tokenised with the byte tokenizer, dropped to ``""`` with probability
  ``caption_dropout`` (classifier-free guidance), encoded, and given to the DiT as the pipelines
  do (zero padding to 512 tokens, computed through :func:`~ditattn.train.flow.text_context`);
- loss: MSE between the DiT output and the velocity ``noise - x0`` at shifted-uniform sigmas
  (optionally shape-weighted: latent positions under a shape count ``1 + fg_weight`` times);
- AdamW with linear warm-up and a linear decay over the budget's last part
  (:meth:`~ditattn.train.recipe.DitStage.lr_factor`), gradient clipping, bf16 autocast on CUDA, an
  EMA of the weights (what ships);
- a stage can continue from a saved package's text encoder + DiT (``init``; the optimizer and the
  EMA start afresh, with a short warm-up).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ditattn.train.flow import flow_pair, install_text_bias, shift_sigmas, text_context
from ditattn.train.recipe import Bucket, Recipe
from ditattn.train.scenes import scene_batch
from ditattn.train.tracking import EMA, Budget, LossLog, progress
from ditattn.train.vae_stage import autocast, normalize_latents

log = logging.getLogger("ditattn.train")


def build_text_encoder(recipe: Recipe, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        return UMT5EncoderModel(UMT5Config(**recipe.text_encoder))


def build_transformer(recipe: Recipe, seed: int):
    """A fresh diffusers ``WanTransformer3DModel`` with a zero output projection (predicts 0 at start)."""
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        model = WanTransformer3DModel(**recipe.transformer)
    torch.nn.init.zeros_(model.proj_out.weight)
    torch.nn.init.zeros_(model.proj_out.bias)
    return model


def grow_blocks(dit, layers: int):
    """A diffusers ``WanTransformer3DModel`` like ``dit`` (L blocks) with ``layers`` >= L blocks, computing
    exactly what ``dit`` does: the L trained blocks keep their order, and each added block is a copy of one
    of them (spread evenly: 6 -> 9 copies blocks 1, 3 and 5), placed right after it, with its self-attention,
    cross-attention and feed-forward output projections zeroed, so it starts as the identity and training
    grows it from there.  Float32, eval mode, on the CPU."""
    from diffusers import WanTransformer3DModel

    old = len(dit.blocks)
    if layers < old:
        raise ValueError(f"grow_blocks: the DiT has {old} blocks; cannot grow it to {layers}")
    extra = layers - old
    copies = [min(old - 1, int((k + 0.5) * old / extra)) for k in range(extra)]
    order = []  # (source block, added?) per new position
    for i in range(old):
        order.append((i, False))
        order.extend((i, True) for _ in range(copies.count(i)))
    sd = dit.state_dict()
    new_sd = {k: v for k, v in sd.items() if not k.startswith("blocks.")}
    zeroed = ("attn1.to_out.0.", "attn2.to_out.0.", "ffn.net.2.")
    for j, (i, added) in enumerate(order):
        for k, v in sd.items():
            if k.startswith(f"blocks.{i}."):
                rest = k[len(f"blocks.{i}.") :]
                new_sd[f"blocks.{j}.{rest}"] = torch.zeros_like(v) if added and rest.startswith(zeroed) else v.clone()
    model = WanTransformer3DModel.from_config(dict(dit.config, num_layers=layers))
    model.load_state_dict(new_sd, strict=True)
    return model.float().eval()


class LatentPool:
    """A ring buffer of ``capacity`` normalised latents (``[N, C, T, h, w]``), their captions and
    (optionally) per-position loss weights (``[N, 1, T, h, w]``)."""

    def __init__(self, capacity: int, storage: torch.device, dtype: torch.dtype):
        self.capacity, self.storage, self.dtype = capacity, storage, dtype
        self.latents: Optional[torch.Tensor] = None
        self.weights: Optional[torch.Tensor] = None
        self.captions: list[str] = []
        self.filled = 0
        self.pos = 0

    def add(self, latents: torch.Tensor, captions: list[str], weights: Optional[torch.Tensor] = None) -> None:
        if self.latents is None:
            self.latents = torch.empty((self.capacity, *latents.shape[1:]), device=self.storage, dtype=self.dtype)
            self.captions = [""] * self.capacity
            if weights is not None:
                self.weights = torch.ones((self.capacity, *weights.shape[1:]), device=self.storage, dtype=self.dtype)
        n = min(latents.shape[0], self.capacity)
        idx = [(self.pos + i) % self.capacity for i in range(n)]
        where = torch.tensor(idx, device=self.storage)
        self.latents[where] = latents[:n].to(self.storage, self.dtype)
        if self.weights is not None and weights is not None:
            self.weights[where] = weights[:n].to(self.storage, self.dtype)
        for i, j in enumerate(idx):
            self.captions[j] = captions[i]
        self.pos = (self.pos + n) % self.capacity
        self.filled = min(self.capacity, self.filled + n)

    def draw(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, list[str], Optional[torch.Tensor]]:
        """``(latents, captions, weights or None)`` of ``n`` entries drawn with replacement."""
        idx = torch.randint(0, self.filled, (n,), generator=g)
        at = idx.to(self.storage)
        weights = None if self.weights is None else self.weights[at]
        return self.latents[at], [self.captions[int(i)] for i in idx], weights


def latent_foreground(clips: torch.Tensor, spatial: int = 8, temporal: int = 4) -> torch.Tensor:
    """Float ``[B, 1, T, H / spatial, W / spatial]``: 1 on the latent positions whose pixels (any of
    their frames: the first frame alone, then groups of ``temporal``, as the Wan VAE compresses
    time) touch a shape of clips ``[B, 3, F, H, W]`` in [-1, 1]."""
    from ditattn.train.vae_stage import foreground

    m = foreground(clips)[:, 0]  # [B, F, H, W]
    B, F_, H, W = m.shape
    m = F.max_pool2d(m, spatial)  # [B, F, h, w]
    rest = m[:, 1:].reshape(B, (F_ - 1) // temporal, temporal, *m.shape[-2:]).amax(dim=2)
    return torch.cat([m[:, :1], rest], dim=1)[:, None]


def bucket_batch(bucket: Bucket, recipe: Recipe) -> int:
    cfg = recipe.dit_stage
    return max(1, min(cfg.max_batch, cfg.batch_tokens // bucket.tokens()))


class TextEncoder:
    """Captions -> ``(context, bias)`` for the DiT (see :func:`ditattn.train.flow.text_context`)."""

    def __init__(self, model, device: torch.device):
        from ditattn.models.local import build_byte_tokenizer

        self.model, self.device = model, device
        self.tokenizer = build_byte_tokenizer()

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(captions, padding="longest", return_tensors="pt")
        ids, mask = enc.input_ids.to(self.device), enc.attention_mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return text_context(hidden, mask)


def train_dit(
    recipe: Recipe,
    vae,
    budget: Budget,
    device: torch.device,
    seed: int,
    losses: LossLog,
    checkpoint: Optional[Callable[[object, object, int], None]] = None,
    checkpoint_every_s: float = 120.0,
    compile_model: bool = False,
    init: Optional[tuple] = None,
):
    """Train the text encoder + DiT on ``vae``'s latents for ``budget``.

    init: ``(text_encoder, transformer)`` to continue from (a saved package's, see
    :func:`ditattn.train.shapes.load_package`), else fresh ones from the recipe (zero output
    projection).  Returns ``(text_encoder, transformer, steps)`` in eval mode holding the EMA
    weights.  ``checkpoint(text_encoder, transformer, step)`` is called with the EMA weights
    swapped in every ``checkpoint_every_s`` seconds (so a run cut short still leaves a model).
    """
    cfg = recipe.dit_stage
    te, dit = init if init is not None else (build_text_encoder(recipe, seed), build_transformer(recipe, seed))
    te, dit = te.to(device), dit.to(device).train().requires_grad_(True)
    proc = install_text_bias(dit)
    train_text = cfg.text_lr > 0
    te.train(train_text).requires_grad_(train_text)
    groups = [{"params": [p for p in dit.parameters()], "lr": cfg.lr}]
    if train_text:
        groups.append({"params": [p for p in te.parameters()], "lr": cfg.text_lr})
    for g_ in groups:
        g_["base_lr"] = g_["lr"]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    trained = [p for g_ in groups for p in g_["params"]]
    ema = EMA(trained, cfg.ema_decay)
    forward = torch.compile(dit) if compile_model else dit
    text = TextEncoder(te, device)
    shift = float(recipe.scheduler["flow_shift"] if cfg.sigma_shift is None else cfg.sigma_shift)

    g_data = torch.Generator().manual_seed(seed + 201)
    g_noise = torch.Generator(device).manual_seed(seed + 202)
    storage_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pools = {b: LatentPool(cfg.pool_batches * bucket_batch(b, recipe), device, storage_dtype) for b in cfg.buckets}
    weights = torch.tensor([b.weight for b in cfg.buckets], dtype=torch.float64)
    losses.start(
        "dit",
        buckets=[[b.height, b.width, b.frames, b.weight, bucket_batch(b, recipe)] for b in cfg.buckets],
        batch_tokens=cfg.batch_tokens,
        text_encoder="trained" if train_text else "frozen",
        params_dit=sum(p.numel() for p in dit.parameters()),
        params_text=sum(p.numel() for p in te.parameters()),
        reuse=cfg.reuse,
        resumed=init is not None,
        fg_weight=cfg.fg_weight,
        sigma_shift=shift,
        shape_weights=None if cfg.shape_weights is None else list(cfg.shape_weights),
        p_two=cfg.p_two,
    )
    bar = progress(budget.steps, "dit")
    step, last_ckpt, encode_s = 0, time.perf_counter(), 0.0
    while not budget.done(step):
        bucket = cfg.buckets[int(torch.multinomial(weights, 1, generator=g_data))]
        B = bucket_batch(bucket, recipe)
        pool = pools[bucket]
        t0 = time.perf_counter()
        chunk = math.ceil(B / cfg.reuse)
        for _ in range(math.ceil(B / chunk) if pool.filled < B else 1):  # one encoder shape per bucket
            with torch.no_grad(), autocast(device):
                clips, caps, _ = scene_batch(
                    chunk,
                    bucket.frames,
                    bucket.height,
                    bucket.width,
                    g_data,
                    device=device,
                    shape_weights=cfg.shape_weights,
                    p_two=cfg.p_two,
                )
                z = vae.encode(clips).latent_dist.mode().float()
                fg = 1.0 + cfg.fg_weight * latent_foreground(clips) if cfg.fg_weight > 0 else None
                pool.add(normalize_latents(vae, z), caps, fg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # so that encode_s measures the rendering + encoding
        encode_s += time.perf_counter() - t0
        x0, caps, weight = pool.draw(B, g_data)
        x0 = x0.float()
        drop = torch.rand(B, generator=g_data) < cfg.caption_dropout
        caps = ["" if d else c for c, d in zip(caps, drop.tolist())]
        sigma = shift_sigmas(torch.rand(B, generator=g_data), shift).to(device)
        noise = torch.randn(x0.shape, generator=g_noise, device=device)
        xt, target = flow_pair(x0, noise, sigma)
        frac = cfg.lr_factor(step, budget.fraction(step), resumed=init is not None)
        for g_ in opt.param_groups:
            g_["lr"] = g_["base_lr"] * frac
        with autocast(device):
            with torch.set_grad_enabled(train_text):
                context, bias = text(caps)
            proc.bias = bias
            pred = forward(xt, sigma * 1000.0, context).sample
        if weight is None:
            loss = F.mse_loss(pred.float(), target)
        else:  # shape-weighted: positions under a shape count 1 + fg_weight times, normalised by the mean weight
            w = weight.float()
            loss = (w * (pred.float() - target) ** 2).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
        opt.step()
        ema.update()
        step += 1
        value = float(loss.detach())
        losses.add("dit", step, budget.elapsed, value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", size=f"{bucket.height}x{bucket.width}x{bucket.frames}", refresh=False)
        if checkpoint is not None and time.perf_counter() - last_ckpt > checkpoint_every_s:
            _with_ema(ema, te, dit, lambda: checkpoint(te, dit, step))
            last_ckpt = time.perf_counter()
    bar.close()
    proc.bias = None
    losses.info["dit"].update(steps=step, seconds=round(budget.elapsed, 1), encode_seconds=round(encode_s, 1))
    log.info(
        "dit: %d steps in %.0f s (%.0f s rendering + encoding), last loss %.4f",
        step,
        budget.elapsed,
        encode_s,
        losses.stages["dit"][-1][2] if losses.stages["dit"] else float("nan"),
    )
    ema.swap()  # keep the averages
    _restore_processors(dit)
    return te.eval().requires_grad_(False), dit.eval().requires_grad_(False), step


def _with_ema(ema: EMA, te, dit, fn) -> None:
    modes = [(m, m.training) for m in (te, dit)]
    ema.swap()
    try:
        te.eval()
        dit.eval()
        fn()
    finally:
        ema.swap()
        for m, was in modes:
            m.train(was)


def _restore_processors(dit) -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for block in dit.blocks:
        block.attn2.set_processor(WanAttnProcessor())
