"""--attention-backend-config parsing and every parameter of upstream's tables (valid and invalid)."""

import json

import pytest

from ditattn import AttentionConfigError, parse_attention_backend_config
from ditattn.attention.config import (
    check_config_keys_used,
    component_override_for,
    parse_component_overrides,
    parse_layer_list,
    validate_backend_config,
)
from ditattn.attention.names import AttentionBackendEnum as B


def test_parse_pairs_types():
    cfg = parse_attention_backend_config("sparsity=0.5,enable_x=true,n=3,name=abc,off=False")
    assert cfg == {"sparsity": 0.5, "enable_x": True, "n": 3, "name": "abc", "off": False}
    assert isinstance(cfg["n"], int)


def test_parse_pairs_keeps_commas_of_lists():
    cfg = parse_attention_backend_config("dense_layers=0,1,dense_steps=4,st_chunk_size=[2,4,4]")
    assert cfg == {"dense_layers": "0,1", "dense_steps": 4, "st_chunk_size": [2, 4, 4]}


def test_parse_json_string_and_files(tmp_path):
    assert parse_attention_backend_config('{"sparsity": 0.5}') == {"sparsity": 0.5}
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"topk": 0.25}))
    assert parse_attention_backend_config(str(j)) == {"topk": 0.25}
    y = tmp_path / "c.yaml"
    y.write_text("sparsity: 0.9\nsta_mode: STA_inference\n")
    assert parse_attention_backend_config(str(y)) == {"sparsity": 0.9, "sta_mode": "STA_inference"}
    yml = tmp_path / "c.yml"
    yml.write_text("tau: 2\n")
    assert parse_attention_backend_config(str(yml)) == {"tau": 2}


@pytest.mark.parametrize(
    "bad,match",
    [
        ("/no/such/file.json", "not found"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a .json/.yaml file path"),
        ("justaword", "expected a .json/.yaml file path"),
        ("=3", "empty key"),
    ],
)
def test_parse_errors(bad, match):
    with pytest.raises(AttentionConfigError, match=match):
        parse_attention_backend_config(bad)


def test_parse_file_holding_a_list_is_an_error(tmp_path):
    f = tmp_path / "c.json"
    f.write_text("[1]")
    with pytest.raises(AttentionConfigError, match="mapping"):
        parse_attention_backend_config(str(f))


def test_parse_none_and_dict():
    assert parse_attention_backend_config(None) == {}
    assert parse_attention_backend_config("") == {}
    assert parse_attention_backend_config({"a": 1}) == {"a": 1}


# (backend, key, valid value, expected default, invalid value, error fragment)
SEED_PARAMS = [
    ("sliding_tile_attn", "mask_strategy_file_path", "/tmp/m.json", None, 5, None),
    ("sliding_tile_attn", "sta_mode", "STA_inference", "STA_inference", "fast", "sta_mode"),
    ("sliding_tile_attn", "skip_time_steps", 3, 15, -1, "skip_time_steps"),
    ("video_sparse_attn", "sparsity", 0.9, 0.0, 1.5, "sparsity"),
    ("sparge_attn", "topk", 1.0, 0.5, 0.0, "topk"),
    ("video_sparse_attn_h3", "VSA_sparsity", 0.5, 0.9, -0.1, "VSA_sparsity"),
    ("video_sparse_attn_h3", "vsa_mode", "compete", "exempt", "other", "vsa_mode"),
    ("video_sparse_attn_h3", "vsa_dense_first_n_steps", 2, 0, "x", "vsa_dense_first_n_steps"),
    ("video_sparse_attn_h3", "vsa_dense_layers", [0, 1], [], [-1], "vsa_dense_layers"),
    ("video_sparse_attn_h3", "vsa_tile_size", 64, 64, 128, "vsa_tile_size"),
    ("hybrid_window_attn_h3", "vdn_h3_dense_smoke", True, False, "yes", "vdn_h3_dense_smoke"),
    ("hybrid_window_attn_h3", "vdn_max_gather_rows", 1000, 200000, 0, "vdn_max_gather_rows"),
    ("vmoba_attn", "temporal_chunk_size", 2, None, 0, "temporal_chunk_size"),
    ("vmoba_attn", "temporal_topk", 2, None, -3, "temporal_topk"),
    ("vmoba_attn", "spatial_chunk_size", [4, 4], None, [4], "spatial_chunk_size"),
    ("vmoba_attn", "spatial_topk", 3, None, 1.5, "spatial_topk"),
    ("vmoba_attn", "st_chunk_size", [2, 4, 4], None, [2, 4], "st_chunk_size"),
    ("vmoba_attn", "st_topk", 5, None, 0, "st_topk"),
    ("vmoba_attn", "moba_select_mode", "threshold", "threshold", "random", "moba_select_mode"),
    ("vmoba_attn", "moba_threshold", 0.5, 0.25, 2.0, "moba_threshold"),
    ("vmoba_attn", "moba_threshold_type", "query_head", "query_head", "bogus", "moba_threshold_type"),
    ("vmoba_attn", "first_full_step", 4, 12, -1, "first_full_step"),
    ("vmoba_attn", "first_full_layer", 1, 0, -1, "first_full_layer"),
    ("vmoba_attn", "temporal_layer", 2, 1, "a", "temporal_layer"),
    ("vmoba_attn", "spatial_layer", 2, 1, -2, "spatial_layer"),
    ("vmoba_attn", "st_layer", 0, 1, 0.5, "st_layer"),
    ("block_sparse_attn", "skip_first_steps", 5, 10, -5, "skip_first_steps"),
    ("block_sparse_attn", "sparsity", 0.5, 0.2, 1.0, "sparsity"),
    ("sol_attn", "tau", 2.0, 1.0, 0.0, "tau"),
    ("sol_attn", "thresh_type", "exact", "diag", "approx", "thresh_type"),
    ("sol_attn", "sink_tokens", 256, 0, -1, "sink_tokens"),
    ("sol_attn", "sink_start", 3, 0, -1, "sink_start"),
    ("sol_attn", "dense_steps", 4, 10, -1, "dense_steps"),
    ("sol_attn", "dense_layers", "0-2", "0,1", "a-b", "dense_layers"),
    ("sol_attn", "dense_backend", "sage_attn", "fa", "torch_sdpa", "dense_backend"),
    ("sol_attn", "kv_splits", "auto", "auto", "many", "kv_splits"),
]


@pytest.mark.parametrize("backend,key,good,default,bad,frag", SEED_PARAMS, ids=[f"{p[0]}.{p[1]}" for p in SEED_PARAMS])
def test_seed_parameter(backend, key, good, default, bad, frag):
    base = {"mask_strategy_file_path": "/tmp/m.json"} if backend == "sliding_tile_attn" else {}
    cfg = validate_backend_config(backend, {**base, key: good})
    assert cfg[key] == good
    if key != "mask_strategy_file_path":
        assert validate_backend_config(backend, base)[key] == default
    if frag is not None:
        with pytest.raises(AttentionConfigError, match=f"{backend}: invalid value .* for '{frag}'"):
            validate_backend_config(backend, {**base, key: bad})


def test_sta_requires_mask_strategy_file():
    with pytest.raises(AttentionConfigError, match="'mask_strategy_file_path' is required"):
        validate_backend_config("sliding_tile_attn", {})


def test_kv_splits_integer_and_layer_lists():
    assert validate_backend_config("sol_attn", {"kv_splits": 4})["kv_splits"] == 4
    with pytest.raises(AttentionConfigError):
        validate_backend_config("sol_attn", {"kv_splits": 0})
    assert parse_layer_list("0,1") == [0, 1]
    assert parse_layer_list("0-2") == [0, 1, 2]
    assert parse_layer_list("3, 0-1") == [0, 1, 3]


def test_unknown_keys_are_named():
    with pytest.raises(AttentionConfigError, match=r"video_sparse_attn: unknown config key\(s\) 'sparsty'.*sparsity"):
        validate_backend_config("video_sparse_attn", {"sparsty": 0.5})
    with pytest.raises(AttentionConfigError, match="takes no parameters"):
        validate_backend_config("torch_sdpa", {"x": 1})
    with pytest.raises(AttentionConfigError, match="belong to no backend in use"):
        check_config_keys_used({"topk": 0.5}, [B.VIDEO_SPARSE_ATTN, B.TORCH_SDPA])
    check_config_keys_used({"sparsity": 0.5}, [B.VIDEO_SPARSE_ATTN, B.TORCH_SDPA])


def test_component_overrides_parsing():
    ov = parse_component_overrides("text_encoder=torch_sdpa, transformer.cross=FA3")
    assert ov == {"text_encoder": B.TORCH_SDPA, "transformer.cross": B.FA}
    assert parse_component_overrides('{"transformer": "cudnn_sdpa"}') == {"transformer": B.TORCH_CUDNN_SDPA}
    with pytest.raises(AttentionConfigError, match="role suffix"):
        parse_component_overrides("transformer.mlp=fa")
    with pytest.raises(AttentionConfigError, match="expected component=backend"):
        parse_component_overrides("transformer")
    with pytest.raises(AttentionConfigError, match="unknown attention backend 'nope'"):
        parse_component_overrides("transformer=nope")
    assert component_override_for(ov, "transformer", "cross")[1:] == ("transformer.cross", "component_role")
    assert component_override_for(ov, "transformer", "self") is None
    assert component_override_for(ov, "transformer_2", "cross")[1] == "transformer.cross"


def test_enum_from_name():
    assert B.from_name("FA4") is B.FA and B.from_name("fa3") is B.FA
    assert B.from_name("cudnn_sdpa") is B.TORCH_CUDNN_SDPA
    assert B.from_name(" Torch_SDPA ") is B.TORCH_SDPA
    assert B.from_name("SLIDING_TILE_ATTN") is B.SLIDING_TILE_ATTN
    with pytest.raises(AttentionConfigError, match="valid names: fa, torch_sdpa"):
        B.from_name("flash")
    assert len(B) == 22


def test_garbage_yaml_config_file_is_one_line_error(tmp_path):
    bad = tmp_path / "cfg.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(AttentionConfigError) as ei:
        parse_attention_backend_config(str(bad))
    msg = str(ei.value)
    assert "\n" not in msg and "line 2" in msg and "accepted: a JSON object or YAML mapping" in msg
