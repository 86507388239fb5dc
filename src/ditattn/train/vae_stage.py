"""Stage 1: the ``AutoencoderKLWan`` on procedural clips (reconstruction + a small KL, as Wan).

Each step renders a batch of clips (9 or 17 frames in the full preset) at one of the recipe's
render sizes (so shapes appear at several scales), crops them to ``crop x crop`` around a shape,
and minimises ``L1 + MSE`` between clip and reconstruction (shape pixels weighted up: at first the
decoder only learns the background) plus ``kl_weight`` x the posterior's KL per element.  A stage
can continue from saved weights, and can train the decoder alone (the encoder frozen, so the
latents a DiT was trained on stay valid).  Afterwards the weights are rounded to float16 (what
ships) and the per-channel mean / std of the latents (posterior means over clips of several sizes)
go into the VAE config (``latents_mean`` / ``latents_std``), which the pipelines use to normalise
latents for the DiT.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ditattn.train.recipe import Recipe
from ditattn.train.scenes import BACKGROUND, scene_batch
from ditattn.train.tracking import Budget, LossLog, progress

log = logging.getLogger("ditattn.train")


def autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


LOGVAR_INIT = -8.0


def build_vae(recipe: Recipe, seed: int):
    """A fresh ``AutoencoderKLWan`` whose posterior starts nearly deterministic: the log-variance
    half of ``quant_conv`` gets bias ``LOGVAR_INIT`` (std 0.02), since at the default init the
    sampling noise (std 1) drowns the encoder's means (~0.15) and the decoder learns nothing
    but the background for hundreds of steps."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**recipe.vae)
    with torch.no_grad():
        vae.quant_conv.bias[vae.config.z_dim :] = LOGVAR_INIT
    return vae


def _crop_on_shapes(x: torch.Tensor, scenes, size: int, g: torch.Generator) -> torch.Tensor:
    """A ``size x size`` crop per clip of ``x [B, C, F, H, W]`` around the mid-clip centre of one
    of its shapes (jittered by up to a quarter of the crop), so crops of large frames are not empty."""
    H, W = x.shape[-2:]
    if H <= size and W <= size:
        return x
    out = []
    for i in range(x.shape[0]):
        k = int(torch.randint(0, int(scenes.present[i].sum()), (1,), generator=g))
        cx = float(scenes.x0[i, k] + scenes.dx[i, k] / 2) * W
        cy = float(scenes.y0[i, k] + scenes.dy[i, k] / 2) * H
        jx, jy = ((torch.rand(2, generator=g) - 0.5) * size / 2).tolist()
        left = int(min(max(cx + jx - size / 2, 0), W - size))
        top = int(min(max(cy + jy - size / 2, 0), H - size))
        out.append(x[i, :, :, top : top + size, left : left + size])
    return torch.stack(out)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLWan.decode`` without its final clamp to [-1, 1] (which would stop the gradient
    of every pixel outside that range): latents ``[B, C, T, h, w]`` -> clip ``[B, 3, F, H, W]``.

    The same causal frame-by-frame loop over diffusers' decoder and its feature cache as
    ``AutoencoderKLWan._decode`` (diffusers 0.42), so ``tests/models/test_train_shapes.py`` checks it
    against ``decode`` on in-range outputs.
    """
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    outs = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        outs.append(
            vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        )
    vae.clear_cache()
    return torch.cat(outs, dim=2)


def foreground(x: torch.Tensor) -> torch.Tensor:
    """Float ``[B, 1, F, H, W]``: 1 where clips ``x [B, 3, F, H, W]`` in [-1, 1] are off the background."""
    bg = torch.tensor(BACKGROUND, device=x.device).view(1, 3, 1, 1, 1) * 2 - 1
    return ((x.float() - bg).abs().amax(dim=1, keepdim=True) > 0.05).float()


def outline(x: torch.Tensor) -> torch.Tensor:
    """Float ``[B, 1, F, H, W]``: 1 on the pixels of clips ``x [B, 3, F, H, W]`` within one pixel of
    an edge (the colour spans more than 0.1 over their 3 x 3 neighbourhood in some channel)."""
    B, C, F_, H, W = x.shape
    y = x.float().transpose(1, 2).reshape(B * F_, C, H, W)
    span = torch.nn.functional.max_pool2d(y, 3, 1, 1) + torch.nn.functional.max_pool2d(-y, 3, 1, 1)
    edge = (span.amax(dim=1, keepdim=True) > 0.1).float()
    return edge.reshape(B, F_, 1, H, W).transpose(1, 2)


def vae_loss(
    vae,
    x: torch.Tensor,
    kl_weight: float,
    generator: Optional[torch.Generator] = None,
    fg_weight: float = 0.0,
    train_encoder: bool = True,
    edge_weight: float = 0.0,
):
    """``(loss, reconstruction)`` for clips ``x [B, 3, F, H, W]`` in [-1, 1]: L1 + MSE per element
    (pixels off the background weigh ``fg_weight`` more, pixels on a shape's outline
    (:func:`outline`: where corners are drawn) ``edge_weight`` more) + ``kl_weight`` x the KL per element.
    ``train_encoder=False`` runs the encoder without gradients and leaves the KL out (it only
    shapes the encoder): the decoder learns to draw the latents the encoder already gives."""
    with torch.set_grad_enabled(train_encoder and torch.is_grad_enabled()):
        post = vae.encode(x).latent_dist
    z = post.mean + post.std * torch.randn(
        post.mean.shape, generator=generator, device=x.device, dtype=post.mean.dtype
    )
    rec = decode_unclamped(vae, z)
    rec32, x32 = rec.float(), x.float()
    err = rec32 - x32
    w = 1.0
    if fg_weight:
        w = w + fg_weight * foreground(x32)
    if edge_weight:
        w = w + edge_weight * outline(x32)
    loss = (w * (err.abs() + err * err)).mean()
    if train_encoder:
        kl = 0.5 * (post.mean.float() ** 2 + post.var.float() - 1.0 - post.logvar.float()).sum() / x.numel()
        loss = loss + kl_weight * kl
    return loss, rec


def encoder_modules(vae) -> list:
    """The modules that make the latents (``encoder`` + ``quant_conv``): frozen when only the decoder trains."""
    return [vae.encoder, vae.quant_conv]


def train_vae(
    recipe: Recipe,
    budget: Budget,
    device: torch.device,
    seed: int,
    losses: LossLog,
    init=None,
    train_encoder: bool = True,
):
    """Train the VAE for ``budget``; returns it (eval, float32, weights rounded to float16).

    init: an ``AutoencoderKLWan`` to continue from (a saved package's, see :func:`load_package_vae`;
    the optimizer starts afresh with ``resume_warmup`` steps), else a fresh one from the recipe.
    train_encoder=False (needs ``init``) trains the decoder only: the encoder, and so the latents
    and their mean / std that a DiT was trained on, stay bit for bit; the latent statistics are
    then kept instead of measured again.
    """
    cfg = recipe.vae_stage
    if not train_encoder and init is None:
        raise ValueError("training the decoder only needs a VAE to start from (init)")
    vae = (init if init is not None else build_vae(recipe, seed)).to(device).train().requires_grad_(True)
    for m in encoder_modules(vae) if not train_encoder else []:
        m.eval().requires_grad_(False)
    params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = cfg.resume_warmup if init is not None else cfg.warmup
    g_data = torch.Generator().manual_seed(seed + 101)
    g_noise = torch.Generator(device).manual_seed(seed + 102)
    losses.start(
        "vae",
        batch=cfg.batch,
        frames=list(cfg.frames),
        crop=cfg.crop,
        render_sizes=list(cfg.render_sizes),
        edge_weight=cfg.edge_weight,
        params=sum(p.numel() for p in vae.parameters()),
        trained_params=sum(p.numel() for p in params),
        train_encoder=train_encoder,
        resumed=init is not None,
    )
    bar = progress(budget.steps, "vae")
    step = 0
    while not budget.done(step):
        size = cfg.render_sizes[int(torch.randint(0, len(cfg.render_sizes), (1,), generator=g_data))]
        frames = cfg.frames[int(torch.randint(0, len(cfg.frames), (1,), generator=g_data))]
        clips, _, scenes = scene_batch(
            cfg.batch_for(frames), frames, size, size, g_data, device=device, p_two=cfg.p_two
        )
        x = _crop_on_shapes(clips, scenes, cfg.crop, g_data)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / warmup)
        with autocast(device):
            loss, _ = vae_loss(
                vae,
                x,
                cfg.kl_weight,
                g_noise,
                fg_weight=cfg.fg_weight,
                train_encoder=train_encoder,
                edge_weight=cfg.edge_weight,
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        losses.add("vae", step, budget.elapsed, value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
    bar.close()
    losses.info["vae"].update(steps=step, seconds=round(budget.elapsed, 1))
    log.info(
        "vae: %d steps in %.0f s (%s), last loss %.4f",
        step,
        budget.elapsed,
        "encoder and decoder" if train_encoder else "decoder only",
        losses.stages["vae"][-1][2] if losses.stages["vae"] else float("nan"),
    )
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # what ships is float16: train the DiT on exactly those latents
        for p in vae.parameters():
            p.copy_(p.half().float())
    if train_encoder:
        set_latent_stats(vae, recipe, device, seed)
    return vae


@torch.no_grad()
def set_latent_stats(vae, recipe: Recipe, device: torch.device, seed: int, clips_per_size: int = 16) -> None:
    """Put the per-channel mean / std of posterior means (over clips of every training size) into
    ``vae.config.latents_mean`` / ``latents_std``."""
    g = torch.Generator().manual_seed(seed + 103)
    sizes = {(b.height, b.width, b.frames) for b in recipe.dit_stage.buckets}
    zs = []
    for h, w, f in sorted(sizes):
        for start in range(0, clips_per_size, 4):
            clips, _, _ = scene_batch(min(4, clips_per_size - start), f, h, w, g, device=device)
            z = vae.encode(clips).latent_dist.mode().float()
            zs.append(z.transpose(0, 1).reshape(z.shape[1], -1))
    z = torch.cat(zs, dim=1)
    mean, std = z.mean(dim=1), z.std(dim=1).clamp(min=1e-3)
    vae.register_to_config(
        latents_mean=[round(float(v), 5) for v in mean], latents_std=[round(float(v), 5) for v in std]
    )


def normalize_latents(vae, z: torch.Tensor) -> torch.Tensor:
    """``(z - latents_mean) / latents_std`` per channel (``z [B, C, T, h, w]``), as the pipelines undo it."""
    mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return (z - mean) / std


@torch.no_grad()
def reconstruction_grid(vae, device: torch.device, seed: int, path: str, size: int = 128, frames: int = 17) -> float:
    """Save originals above reconstructions (first / middle / last frame of 4 clips); returns the PSNR (dB)."""
    import numpy as np
    from PIL import Image

    g = torch.Generator().manual_seed(seed + 104)
    clips, _, _ = scene_batch(4, frames, size, size, g, device=device)
    rec = vae.decode(vae.encode(clips).latent_dist.mode()).sample.clamp(-1, 1)
    mse = float(((rec.float() - clips.float()) / 2).pow(2).mean())
    picks = [0, frames // 2, frames - 1]

    def row(v):
        v = ((v.float() + 1) * 127.5).round().clamp(0, 255).byte().cpu()
        return np.concatenate([v[:, :, f].permute(0, 2, 3, 1).reshape(-1, size, 3).numpy() for f in picks], axis=1)

    Image.fromarray(np.concatenate([row(clips), row(rec)], axis=1)).save(path)
    return 10 * float(np.log10(1.0 / max(mse, 1e-12)))
