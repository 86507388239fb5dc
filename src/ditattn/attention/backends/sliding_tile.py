"""``sliding_tile_attn``: sliding-tile attention (windows on 3-D tile coordinates, searched or from a mask
strategy), on the in-tree sparse engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    layer_index,
    layer_stats_key,
    run_dense,
    sparse_backend,
    sparse_done,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    P,
    list_len,
    non_negative,
)
from ditattn.attention.sparse import record_stats
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
    get_search,
    load_mask_strategy,
    parse_candidates,
    sliding_tile_attention,
    sta_search_attention,
)
from ditattn.attention.specs import ALL_FLOAT, IN_TREE_SPARSE, BackendSpec

Tensor = torch.Tensor


SEARCH_MODES = ("STA_searching", "STA_tuning", "STA_tuning_cfg")


SLIDING_TILE_ATTN_SCHEMA = (
    P(
        "mask_strategy_file_path",
        "str",
        None,
        "Path to the mask strategy JSON ('t_l_h' -> [wt, wh, ww] in tiles); written by STA_searching/STA_tuning",
        required=True,
        accepted="a path to a JSON file",
    ),
    P(
        "sta_mode",
        "str",
        "STA_inference",
        "STA mode",
        choices=("STA_inference", "STA_searching", "STA_tuning", "STA_tuning_cfg"),
    ),
    P(
        "skip_time_steps",
        "int",
        15,
        "Steps of full attention before switching to sparse",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "tile_size",
        "list[int]",
        [4, 4, 4],
        "Tile size (T, H, W) in latent tokens after patching",
        check=list_len(3),
        accepted="3 positive integers",
    ),
    P(
        "window_candidates",
        "list[int]",
        [],
        "STA_searching: flattened list of candidate windows [wt,wh,ww,...] (empty = built-in set)",
        check=lambda v: None if len(v) % 3 == 0 else "length must be a multiple of 3",
        accepted="a multiple of 3 integers",
    ),
    BLOCK_SPARSE_IMPL,
)


@sparse_backend(
    B.SLIDING_TILE_ATTN,
    schema=SLIDING_TILE_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="sparse",
        summary="Sliding Tile Attention (3-D tile windows per step/layer/head)",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=ALL_FLOAT,
        cross_attention=False,
        causal=False,
        lossy=True,
        config_schema="sliding_tile_attn",
        notes="in-tree block-sparse engine (any resolution; upstream st_attn not needed); "
        "mask_strategy_file_path required",
    ),
)
def sliding_tile_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    mode = cfg["sta_mode"]
    path = cfg["mask_strategy_file_path"]
    tile_size = tuple(cfg.get("tile_size") or (4, 4, 4))
    strategy = load_mask_strategy(path) if mode == "STA_inference" else None
    if call.step is not None and call.step < cfg["skip_time_steps"]:
        return run_dense(name, q, k, v, call, f"step {call.step} < skip_time_steps {cfg['skip_time_steps']}")
    head_offset = int(getattr(call, "head_offset", 0) or 0)
    if mode in SEARCH_MODES:
        search = get_search(path, mode, parse_candidates(cfg.get("window_candidates")))
        out, lse = sta_search_attention(
            q,
            k,
            v,
            video_shape=vs,
            search=search,
            step=0 if call.step is None else int(call.step),
            layer=layer_index(call),
            head_offset=head_offset,
            tile_size=tile_size,
            text_len=text_len,
            scale=call.scale,
            return_lse=call.return_lse,
            impl=cfg["block_sparse_impl"],
        )
        record_stats(
            layer_stats_key(name, call),
            backend=name,
            kept_fraction=1.0,
            dense=True,
            reason=f"{mode}: full attention returned, candidates measured",
            step=call.step,
            layer_idx=call.layer_idx,
        )
        return out, lse
    windows = strategy.windows(call.step, layer_index(call), q.shape[2], head_offset)
    out, lse, plan = sliding_tile_attention(
        q,
        k,
        v,
        video_shape=vs,
        windows=windows,
        tile_size=tile_size,
        text_len=text_len,
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
    )
    sparse_done(name, call, plan, windows=windows.tolist())
    return out, lse
