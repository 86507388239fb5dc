"""``UlyssesAttention`` and ``USPAttention``: sequence-parallel attention modules.

Both are :class:`~ditattn.attention.layer.LocalAttention` subclasses: the backend is resolved at
construction by the same selector (so the plan, component overrides, the per-request override
table, autotune and the capability rules apply unchanged), and with one rank (or without
``torch.distributed``) ``forward`` *is* ``LocalAttention.forward``.

Under sequence parallelism (``N = U × R`` ranks, see :mod:`ditattn.distributed.groups`) each rank
passes its chunk of the sequence; for self-attention:

1. **Ulysses** (``U > 1``): an all-to-all turns sequence chunks into head shards, so the backend
   sees ``H / U`` whole heads over the Ulysses group's whole block — for ``R = 1`` the full
   sequence, so sparse video backends see the same tokens, ``video_shape`` and ``text_len`` as on
   one device.  Heads must divide by ``U``; K/V heads (GQA) that do not divide are expanded.
2. **Ring** (``R > 1``): K/V blocks rotate around the ring group and the partial outputs merge by
   their LSE, so the backend must return the LSE (the selector adds that requirement for
   self-attention when the ring degree is above 1 and refuses other backends at construction).
3. The reverse all-to-all returns each rank's chunk for all heads.

**Replicated tokens** (e.g. text in joint attention): the last ``replicated_len`` tokens of q/k/v
are the same on every rank (default: the forward context's ``text_len``).  They are never sent:
each rank slices its heads locally, attends them over the whole sequence, and only their outputs
are all-gathered over the Ulysses group (identical on every rank afterwards).

**Cross-attention** (``role="cross"``) to replicated K/V (e.g. text): each rank attends its local
query chunk; no communication.

**Padding**: when the sequence does not divide by ``N`` the model pads it at the end (see
:func:`ditattn.distributed.comm.shard_sequence`); the layer drops padded keys so they are never
attended (their output rows are zero and are cropped by ``gather_sequence``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.context import current_forward, current_settings
from ditattn.attention.layer import LocalAttention
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import SPECS
from ditattn.distributed.comm import RingComm, gather_heads, head_to_seq, pad_seq, seq_to_head, shard_length
from ditattn.distributed.groups import SequenceParallelGroups, check_heads_divisible, get_sequence_parallel
from ditattn.distributed.ring import ring_attention
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor


def lse_backends() -> list[str]:
    """Backends whose capability data says they return the softmax LSE (ring-capable)."""
    return [b.value for b in B if SPECS[b].returns_lse]


def _effective_degrees(groups: Optional[SequenceParallelGroups]) -> tuple[int, int]:
    """``(U, R)`` of this process: the initialised groups, else the run settings."""
    st = current_settings()
    su, sr = max(1, st.ulysses_degree or 1), max(1, st.ring_degree or 1)
    if groups is None:
        return su, sr
    if (su, sr) != (1, 1) and (su, sr) != (groups.ulysses_degree, groups.ring_degree):
        raise AttentionConfigError(
            f"the attention settings ask for Ulysses {su} × ring {sr}, but the process groups were built "
            f"for Ulysses {groups.ulysses_degree} × ring {groups.ring_degree}; use the same degrees for both"
        )
    return groups.ulysses_degree, groups.ring_degree


class USPAttention(LocalAttention):
    """Unified sequence-parallel attention (Ulysses × ring) over ``[batch, seq, heads, head_dim]``.

    Constructor: as :class:`LocalAttention`.  The Ulysses and ring degrees come from the current
    process groups (:func:`ditattn.distributed.groups.init_sequence_parallel`) or, before those
    exist (e.g. ``ditattn plan``), from ``AttentionSettings.ulysses_degree/ring_degree``.
    Raises :class:`AttentionConfigError` when self-attention heads do not divide by the Ulysses
    degree, or when ring is on and the resolved backend (after any platform substitution) does not
    return the LSE (sparse backends run under Ulysses only).

    ``forward(q, k, v, attn_bias=None, return_lse=False, *, replicated_len=None, seq_len=None)``

    * self-attention: q, k, v ``[B, s + r, H|Hkv, D]`` — this rank's ``s`` tokens of the sharded
      sequence followed by ``r = replicated_len`` replicated tokens (default: the forward
      context's ``text_len``).  ``seq_len``: the real length ``L`` of the sharded sequence (default:
      ``prod(video_shape)`` of the forward context, else ``s × N``); ``s`` must equal
      ``ceil(L / N)``.  Returns ``[B, s + r, H, D]`` (and LSE ``[B, H, s + r]`` float32 with
      ``return_lse``): rows of this rank's chunk, then the replicated rows (same on all ranks).
    * cross-attention: q ``[B, s, H, D]`` local, k/v ``[B, Skv, Hkv, D]`` replicated; local only.

    ``attn_bias`` is refused under sequence parallelism with more than one rank.
    """

    _ring_allowed = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: Optional[int] = None,
        *,
        role: str = "self",
        needs_lse: bool = False,
        **kw,
    ):
        groups = get_sequence_parallel()
        u, r = _effective_degrees(groups)
        prefix = kw.get("prefix", "")
        where = f"{prefix or type(self).__name__} (self-attention)"
        if role == "self":
            if r > 1 and not self._ring_allowed:
                raise AttentionConfigError(
                    f"{where}: {type(self).__name__} shards heads only, but the run uses ring degree {r}; "
                    f"use USPAttention (Ulysses × ring) or --ring-degree 1"
                )
            check_heads_divisible(num_heads, u, where)
            needs_lse = needs_lse or r > 1
        self.ulysses_degree, self.ring_degree = (u, r) if role == "self" else (1, 1)
        try:
            super().__init__(num_heads, head_dim, num_kv_heads, role=role, needs_lse=needs_lse, **kw)
        except AttentionConfigError as exc:
            if role == "self" and r > 1:
                self._explain_ring_refusal(exc, r)
            raise
        if role == "self" and r > 1:
            self._check_ring_backend(self.backend)

    # -- rules ------------------------------------------------------------------------------------
    def _explain_ring_refusal(self, exc: AttentionConfigError, r: int) -> None:
        """Add to a construction refusal under ring what ring needs, and, when the platform would have
        substituted a backend that lacks the LSE, that substitution (the selector reports only the
        requested backend's own reasons then)."""
        notes = []
        asked = getattr(exc, "backend", None)
        if asked is not None and "LSE" not in str(exc):
            import dataclasses

            from ditattn.attention import selector
            from ditattn.platforms import current_platform

            try:
                req = dataclasses.replace(self.spec.request(), needs_lse=False)
                sub = selector.substitute(B.from_name(asked), req, current_platform())
            except Exception:  # the explanation must never mask the refusal itself
                sub = None
            if sub is not None and not SPECS[sub[0]].returns_lse:
                notes.append(
                    f"the platform would run {sub[0].value} instead ({sub[1]}), which does not return the LSE"
                )
        if notes or "LSE" in str(exc):
            notes.append(
                f"ring attention (ring degree {r}) merges partial outputs by their LSE, so it needs a "
                f"backend that returns it: {', '.join(lse_backends())}; sparse backends run under "
                f"Ulysses only (--ulysses-degree)"
            )
            if isinstance(getattr(exc, "reasons", None), list):
                exc.reasons.extend(notes)
            exc.args = (f"{exc}; " + "; ".join(notes),)

    def _check_ring_backend(self, backend: B) -> None:
        spec = SPECS[backend]
        if spec.returns_lse:
            return
        what = "a sparse backend (sparse backends run under Ulysses only)" if spec.sparse else "a backend without LSE"
        raise AttentionConfigError(
            f"{self.component + '.' if self.component else ''}{self.prefix or type(self).__name__}: ring attention "
            f"(ring degree {self.ring_degree}) needs a backend that returns the softmax LSE "
            f"({', '.join(lse_backends())}), but this layer runs {backend.value}, {what}"
        )

    def rebind(self, backend: B, source: str, reason: Optional[str] = None) -> None:
        if self.role == "self" and self.ring_degree > 1:
            self._check_ring_backend(backend)
        super().rebind(backend, source, reason)

    def _active_groups(self) -> Optional[SequenceParallelGroups]:
        g = get_sequence_parallel()
        if g is None or g.world_size == 1 or self.role != "self":
            return None
        if (g.ulysses_degree, g.ring_degree) != (self.ulysses_degree, self.ring_degree):
            raise AttentionConfigError(
                f"{self.prefix or type(self).__name__}: built for Ulysses {self.ulysses_degree} × ring "
                f"{self.ring_degree} but running under Ulysses {g.ulysses_degree} × ring {g.ring_degree}; "
                f"rebuild the model after init_sequence_parallel()"
            )
        return g

    # -- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_bias: Optional[Tensor] = None,
        return_lse: bool = False,
        *,
        replicated_len: Optional[int] = None,
        seq_len: Optional[int] = None,
    ):
        g = self._active_groups()
        if g is None:  # one rank, or cross-attention to replicated K/V: purely local
            return super().forward(q, k, v, attn_bias=attn_bias, return_lse=return_lse)
        if attn_bias is not None:
            raise AttentionConfigError(
                f"{self.prefix or type(self).__name__}: an attention bias/mask is not supported under sequence "
                f"parallelism ({g.world_size} ranks); run this layer on one rank"
            )
        backend, impl, config = self._request_binding()
        if impl is None:
            impl = self.impl
        if g.ring_degree > 1 and backend is not self.backend:
            self._check_ring_backend(backend)
        if q.dtype not in self._ok_dtypes:
            self._check_dtype(q.dtype, backend)
        return self._sp_forward(g, backend, impl, config, q, k, v, return_lse, replicated_len, seq_len)

    def _sp_forward(
        self, g: SequenceParallelGroups, backend: B, impl, config, q, k, v, return_lse, replicated_len, seq_len
    ):
        fwd = current_forward()
        n_ranks, U, R = g.world_size, g.ulysses_degree, g.ring_degree
        rep = fwd.text_len if replicated_len is None else int(replicated_len)
        bsz, total, heads, dim = q.shape
        if k.shape[1] != total or v.shape[1] != total:
            raise AttentionConfigError(
                f"{self.prefix or type(self).__name__}: self-attention under sequence parallelism needs q, k, v "
                f"of the same length, got {total}, {k.shape[1]}, {v.shape[1]}"
            )
        if not 0 <= rep <= total:
            raise AttentionConfigError(f"replicated_len {rep} must lie in [0, {total}]")
        s = total - rep
        check_heads_divisible(heads, U, self.prefix or type(self).__name__)
        video_shape = fwd.video_shape
        if seq_len is None:
            seq_len = math.prod(video_shape) if video_shape is not None else s * n_ranks
        if seq_len < 1 or shard_length(seq_len, n_ranks) != s:
            raise AttentionConfigError(
                f"{self.prefix or type(self).__name__}: this rank holds {s} sharded tokens, but a sequence of "
                f"{seq_len} tokens over {n_ranks} ranks gives ceil({seq_len}/{n_ranks}) = "
                f"{shard_length(seq_len, n_ranks)} per rank (shard it with ditattn.distributed.shard_sequence)"
            )
        if video_shape is not None and math.prod(video_shape) != seq_len:
            video_shape = None  # the grid does not describe this sequence
        if self.causal and rep:
            raise AttentionConfigError("causal attention with replicated tokens is not supported")
        hkv = k.shape[2]
        if U > 1 and hkv % U:  # GQA heads that do not split: give every query head its own K/V head
            rep_factor = heads // hkv
            k, v = k.repeat_interleave(rep_factor, dim=2), v.repeat_interleave(rep_factor, dim=2)
            hkv = heads
        qs, ks, vs = q[:, :s], k[:, :s], v[:, :s]
        qr, kr, vr = q[:, s:], k[:, s:], v[:, s:]

        # 1. Ulysses: sequence chunks -> head shards (replicated rows: local head slice, no comm)
        if U > 1:
            j = g.ulysses_rank
            if hkv == heads:
                qkv = seq_to_head(torch.cat([qs, ks, vs], dim=0), g.ulysses_group, U)
                qs, ks, vs = qkv.split(bsz, dim=0)
            else:
                qs = seq_to_head(qs, g.ulysses_group, U)
                kv = seq_to_head(torch.cat([ks, vs], dim=0), g.ulysses_group, U)
                ks, vs = kv.split(bsz, dim=0)
            h, hk = heads // U, hkv // U
            qr, kr, vr = (
                qr[:, :, j * h : (j + 1) * h],
                kr[:, :, j * hk : (j + 1) * hk],
                vr[:, :, j * hk : (j + 1) * hk],
            )
        block = qs.shape[1]  # U * s tokens: this Ulysses group's contiguous block
        valid = [max(0, min(block, seq_len - b * block)) for b in range(R)]
        mine = valid[g.ring_rank]

        def call(causal: bool, lse: bool, vshape, tlen) -> AttnCall:
            return AttnCall(
                causal=causal,
                scale=self.scale,
                attn_bias=None,
                video_shape=vshape,
                text_len=tlen,
                step=fwd.step,
                num_steps=fwd.num_steps,
                layer_idx=self.layer_idx,
                return_lse=lse,
                layer_key=f"{self.component}.{self.prefix}" if self.component else self.prefix,
                head_offset=(g.ulysses_rank * (heads // U)) if U > 1 else 0,
            )

        # 2. attention over the whole sequence
        if R == 1:
            qa = torch.cat([qs[:, :mine], qr], dim=1) if rep else qs[:, :mine]
            ka = torch.cat([ks[:, :mine], kr], dim=1) if rep else ks[:, :mine]
            va = torch.cat([vs[:, :mine], vr], dim=1) if rep else vs[:, :mine]
            out, lse = impl(qa, ka, va, call(self.causal, return_lse, video_shape, rep), config)
            if return_lse and lse is None:
                raise AttentionConfigError(f"backend {backend.value} did not return the LSE that was asked for")
        else:
            ring_call = call(False, True, None, 0)
            causal_call = call(True, True, None, 0)

            def attend(qq, kk, vv, causal):
                o, l = impl(qq, kk, vv, causal_call if causal else ring_call, config)
                if l is None:
                    raise AttentionConfigError(
                        f"backend {backend.value} returned no LSE; ring attention cannot merge its blocks"
                    )
                return o, l

            comm = RingComm(g.ring_group, g.ring_ranks, g.ring_rank)
            qa = torch.cat([qs[:, :mine], qr], dim=1) if rep else qs[:, :mine]
            out, lse = ring_attention(
                qa,
                ks,
                vs,
                attend,
                comm,
                block_valid=valid,
                q_valid=mine,
                extra_kv=(kr, vr) if rep else None,
                causal=self.causal,
            )

        # 3. back: head shards -> sequence chunks (replicated rows: all-gather the heads)
        out_s = pad_seq(out[:, :mine], block)
        out_s = head_to_seq(out_s, g.ulysses_group, U) if U > 1 else out_s
        if rep:
            out_r = gather_heads(out[:, mine:], g.ulysses_group, U) if U > 1 else out[:, mine:]
            result = torch.cat([out_s, out_r], dim=1)
        else:
            result = out_s
        if not return_lse:
            return result
        lse_s = pad_seq(lse[:, :, :mine].transpose(1, 2), block, float("-inf"))  # [B, block, h]
        if U > 1:
            lse_s = head_to_seq(lse_s.unsqueeze(-1).contiguous(), g.ulysses_group, U).squeeze(-1)
        lse_out = lse_s.transpose(1, 2)
        if rep:
            lse_r = lse[:, :, mine:].transpose(1, 2).unsqueeze(-1).contiguous()
            lse_r = gather_heads(lse_r, g.ulysses_group, U).squeeze(-1) if U > 1 else lse_r.squeeze(-1)
            lse_out = torch.cat([lse_out, lse_r.transpose(1, 2)], dim=2)
        return result, lse_out.contiguous()


class UlyssesAttention(USPAttention):
    """Ulysses-only sequence-parallel attention: all-to-all between sequence and head shards over
    every sequence-parallel rank (ring degree must be 1; otherwise use :class:`USPAttention`).
    Same constructor and ``forward`` as :class:`USPAttention`."""

    _ring_allowed = False


def sp_attention_layers(modules: Sequence[torch.nn.Module]) -> list[USPAttention]:
    """Every sequence-parallel attention layer in ``modules``."""
    out: list[USPAttention] = []
    for m in modules:
        out.extend(x for x in m.modules() if isinstance(x, USPAttention))
    return out
