"""FlashAttention-4's block-sparse forward (``flash_attn.cute``) behind the engine's block lists.

FA4 takes two lists of key blocks per (batch, head, query block): *full* blocks, computed without a
mask, and *mask* blocks, whose logits first go through a ``mask_mod``.  The engine hands over one list
(:mod:`.block_sparse_triton`'s format) and a key-validity vector ``kv_valid``:

* no padding, or padding that is one ragged end shared by the batch (a valid prefix): every listed
  block is a full block and FA4 masks the ragged end through the key length (keys cut to the prefix);
* padding elsewhere (a tile layout pads the blocks cut by the grid edge: at 21x30x52 in 4x4x8 tiles,
  6 of 259 blocks), shared by the batch: a listed block without padding stays a full block, one that
  holds padding becomes a mask block, and the ``mask_mod`` (:func:`valid_key_mod`) reads the validity
  of each key from an int32 copy of ``kv_valid``, so padding keys get ``-inf``.  The lists are split on
  the device in one launch (:func:`split_lists`, no sync); the few mask blocks cost the per-element mask.

Padding that differs between batch entries is not served here (:func:`shared_validity` says why; the Triton
kernel takes it).  What it buys: Sparge's 128-token setting at 1.8-1.9x FA4 dense against 1.3-1.4x for the
same rule at 64-token tiles on the Triton kernel (docs/benchmarks.md, "Fast settings").
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import identity_cached

#: what impl="fa4" accepts
BLOCK_SIZES = (64, 128)
_LISTS_CACHE: dict = {}
_VALID_CACHE: dict = {}


@functools.lru_cache(maxsize=None)
def installed():
    """``(flash_attn_func, BlockSparseTensorsTorch)`` of FlashAttention-4, or None when not installed."""
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception:
        return None
    return flash_attn_func, BlockSparseTensorsTorch


@functools.lru_cache(maxsize=None)
def valid_key_mod():
    """FA4 ``mask_mod`` (CuTe DSL): key ``n`` is attended when ``aux_tensors[0][n]`` (int32, one entry per
    key) is non-zero.  Built on first use (imports the CUTLASS DSL)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def valid_key(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        ok = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
        return ok != utils.scalar_to_ssa(0, cutlass.Int32)

    return valid_key


def fits(q: torch.Tensor, block_size: int) -> Optional[str]:
    """Why FA4's block-sparse forward cannot take a call of ``q`` at ``block_size`` (None: it can)."""
    if installed() is None:
        return "flash_attn.cute (flash-attn-4) is not installed"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] not in (9, 10):
        return "FlashAttention-4 block sparsity runs on SM90/SM100 only"
    if block_size not in BLOCK_SIZES:
        return f"FlashAttention-4 block sparsity takes block sizes {list(BLOCK_SIZES)}, not {block_size}"
    if q.shape[-1] > 128:
        return "head dims above 128 use the Triton kernel"
    return None


def shared_validity(kv_valid: torch.Tensor) -> Optional[str]:
    """Why the mask path cannot take ``kv_valid`` bool ``[B, S_kv]`` (None: it can): it reads one validity
    vector, so the batch must share it (``B == 1`` or a broadcast row, as a tile layout's ``kv_valid`` is)."""
    if kv_valid.shape[0] > 1 and kv_valid.stride(0) != 0:
        return "kv_valid pads inside key blocks differently per batch entry (the mask path reads one shared row)"
    return None


def split_lists(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, partial: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split block lists into FA4's full and mask lists.

    ``kv_indices`` int32 ``[B, H, n_q, m]`` and ``kv_counts`` int32 ``[B, H, n_q]`` (the engine's format:
    the first ``kv_counts`` entries of a row are its key blocks); ``partial`` bool ``[n_kv]``: the key
    blocks that hold padding (bool or int8).  Returns ``(full_idx, full_cnt, mask_idx, mask_cnt)`` in the same shapes:
    each row's blocks without padding, then those with, in list order; entries past a count are 0.
    One Triton launch on CUDA, a PyTorch scatter elsewhere; no device sync."""
    idx = kv_indices.contiguous()
    cnt = kv_counts.contiguous()
    if idx.is_cuda:
        return _split_lists_cuda(idx, cnt, partial)
    m = idx.shape[-1]
    live = torch.arange(m, device=idx.device) < cnt[..., None].long()
    pad = partial.to(idx.device).bool()[idx.long().clamp(0, partial.numel() - 1)] & live

    def compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.where(sel, sel.long().cumsum(-1) - 1, m)
        out = torch.zeros(*idx.shape[:-1], m + 1, dtype=idx.dtype, device=idx.device)
        out.scatter_(-1, pos, torch.where(sel, idx, torch.zeros_like(idx)))
        return out[..., :m].contiguous(), sel.sum(-1).to(torch.int32)

    full_idx, full_cnt = compact(live & ~pad)
    mask_idx, mask_cnt = compact(pad)
    return full_idx, full_cnt, mask_idx, mask_cnt


@triton.jit
def _split_lists_kernel(Idx, Cnt, Partial, FullIdx, FullCnt, MaskIdx, MaskCnt, M, WIDTH: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, WIDTH)
    live = offs < tl.load(Cnt + row)
    idx = tl.load(Idx + row * M + offs, mask=live, other=0)
    pad = live & (tl.load(Partial + idx, mask=live, other=0) != 0)
    full = live & (pad == 0)
    tl.store(FullIdx + row * M + tl.cumsum(full.to(tl.int32), 0) - 1, idx, mask=full)
    tl.store(MaskIdx + row * M + tl.cumsum(pad.to(tl.int32), 0) - 1, idx, mask=pad)
    tl.store(FullCnt + row, tl.sum(full.to(tl.int32), 0))
    tl.store(MaskCnt + row, tl.sum(pad.to(tl.int32), 0))


def _split_lists_cuda(idx: torch.Tensor, cnt: torch.Tensor, partial: torch.Tensor):
    """:func:`split_lists` in one Triton launch: one program per list row."""
    m = idx.shape[-1]
    rows = cnt.numel()
    full_idx, mask_idx = torch.zeros_like(idx), torch.zeros_like(idx)
    full_cnt, mask_cnt = torch.empty_like(cnt), torch.empty_like(cnt)
    flags = partial if partial.dtype == torch.int8 else partial.to(torch.int8)
    _split_lists_kernel[(rows,)](
        idx, cnt, flags, full_idx, full_cnt, mask_idx, mask_cnt, m, WIDTH=triton.next_power_of_2(m)
    )
    return full_idx, full_cnt, mask_idx, mask_cnt


def _validity(kv_valid: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int32 [S_kv] key validity, int8 [S_kv / block_size] blocks holding padding)`` of a batch-shared
    ``kv_valid``, once per tensor object (:func:`identity_cached`)."""

    def build():
        row = kv_valid[0]
        return row.to(torch.int32).contiguous(), (~row.view(-1, block_size).all(-1)).to(torch.int8)

    return identity_cached(_VALID_CACHE, (kv_valid,), (block_size,), build)


def call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    kv_valid: Optional[torch.Tensor],
    valid_len: Optional[int],
    any_empty: bool,
    return_lse: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FA4's block-sparse forward over the engine's lists (q/k/v ``[B, S, H, D]``, lists as in
    :func:`split_lists`, broadcast B/H allowed).  ``valid_len``: the valid key prefix (None: padding is not a
    prefix, the mask path); ``any_empty``: some query block lists no key block (its rows are set to zero and
    LSE ``-inf``, the engine's contract).  The caller checked :func:`fits`.  Returns ``(out, lse float32 or
    None)``."""
    flash_attn_func, BST = installed()
    B, H = q.shape[0], q.shape[2]
    masked = kv_valid is not None and valid_len is None
    if not masked and valid_len is not None and valid_len < k.shape[1]:
        k, v = k[:, :valid_len], v[:, :valid_len]  # FA4 masks the ragged end of the key sequence itself

    if masked:
        aux, partial = _validity(kv_valid, block_size)

        def build():  # per list object: the split lists (one launch)
            idx = kv_indices.expand(B, H, -1, -1)
            cnt = kv_counts.expand(B, H, -1)
            fi, fc, mi, mc = split_lists(idx, cnt, partial)
            return BST(
                mask_block_cnt=mc,
                mask_block_idx=mi,
                full_block_cnt=fc,
                full_block_idx=fi,
                block_size=(block_size, block_size),
            )

        tensors = identity_cached(_LISTS_CACHE, (kv_indices, kv_counts, kv_valid), (B, H, block_size), build)
        extra = dict(mask_mod=valid_key_mod(), aux_tensors=[aux])
    else:

        def build():  # FA4's list format, once per plan (cached: no per-call copies on the host path)
            idx = kv_indices.expand(B, H, -1, -1).contiguous()
            cnt = kv_counts.expand(B, H, -1).contiguous()
            return BST(
                mask_block_cnt=torch.zeros_like(cnt),
                mask_block_idx=torch.zeros_like(idx),
                full_block_cnt=cnt,
                full_block_idx=idx,
                block_size=(block_size, block_size),
            )

        tensors = identity_cached(_LISTS_CACHE, (kv_indices, kv_counts), (B, H, block_size), build)
        extra = {}
    out, lse = flash_attn_func(
        q, k, v, softmax_scale=scale, block_sparse_tensors=tensors, return_lse=return_lse, **extra
    )
    if any_empty:  # our contract: rows with no key block are zero with LSE -inf
        counts = kv_counts.expand(B, H, -1)
        rows = (counts == 0).repeat_interleave(block_size, dim=2)  # [B, H, Sq]
        out = out.masked_fill(rows.transpose(1, 2)[..., None], 0.0)
        if lse is not None:
            lse = lse.masked_fill(rows, float("-inf"))
    return out, (lse.float() if return_lse else None)
