"""Every component-override rule (selection priority, component and role keys), observed through
``ditattn plan --json`` on the built-in tiny models, on this CPU and on simulated GPUs."""

import json

import pytest

from ditattn.cli import main
from ditattn.platforms import Platform, use_platform

H200_FA4 = Platform.simulate("cuda", capability=(9, 0), packages={"flash_attn.cute", "triton"})
H200_BARE = Platform.simulate("cuda", capability=(9, 0), packages={"triton"})


def plan(capsys, *argv, platform=None):
    """Run ``ditattn plan --json ARGV`` in-process; return (exit code, plan dict or stderr text)."""
    capsys.readouterr()
    if platform is None:
        rc = main(["plan", "--json", *argv])
    else:
        with use_platform(platform):
            rc = main(["plan", "--json", *argv])
    out = capsys.readouterr()
    if rc == 0:
        return rc, json.loads(out.out)
    return rc, out.err


def layers(p, comp, role=None):
    for c in p["components"]:
        if c["name"] == comp:
            return [l for l in c["layers"] if role is None or l["role"] == role]
    raise KeyError(comp)


def summary(p, comp, role):
    ls = layers(p, comp, role)
    assert ls, (comp, role)
    return {(l["backend"], l["source"]) for l in ls}


def test_default_plan_shape(capsys):
    rc, p = plan(capsys)
    assert rc == 0
    assert p["platform"] == {"name": "cpu", "device": "cpu", "capability": None}
    assert [c["name"] for c in p["components"]] == ["text_encoder", "transformer", "vae"]
    assert [c["selectable"] for c in p["components"]] == [True, True, False]
    assert layers(p, "vae") == []
    tr = layers(p, "transformer")
    assert [(l["prefix"], l["role"]) for l in tr] == [  # the default model, ditattn:shapes: 6 blocks
        (f"blocks.{i}.attn{j}", role) for i in range(6) for j, role in ((1, "self"), (2, "cross"))
    ]
    for l in tr + layers(p, "text_encoder"):
        assert set(l) >= {"prefix", "role", "backend", "source", "fallback_reason"}
        assert l["backend"] == "torch_sdpa" and l["fallback_reason"] is None
    assert {l["source"] for l in tr} == {"auto"}
    assert {l["source"] for l in layers(p, "text_encoder")} == {"layer_default"}  # UMT5 declares torch_sdpa


@pytest.mark.parametrize("backend", ["video_sparse_attn", "sliding_tile_attn"])
def test_global_sparse_backend_self_uses_it_cross_falls_back(capsys, tmp_path, backend):
    argv = ["--attention-backend", backend]
    if backend == "sliding_tile_attn":
        mask = tmp_path / "mask.json"
        mask.write_text(json.dumps({"0_0_0": [1, 2, 2]}))
        argv += ["--attention-backend-config", f"mask_strategy_file_path={mask}"]
    rc, p = plan(capsys, *argv)
    assert rc == 0, p
    assert summary(p, "transformer", "self") == {(backend, "cli")}
    cross = layers(p, "transformer", "cross")
    assert {l["backend"] for l in cross} == {"torch_sdpa"}
    assert all("sparse" in l["fallback_reason"] and "cross-attention" in l["fallback_reason"] for l in cross)
    # the auxiliary text encoder falls back to its declared default and says why
    te = layers(p, "text_encoder")
    assert {l["backend"] for l in te} == {"torch_sdpa"}
    assert all("bias" in l["fallback_reason"] for l in te)


def test_sparse_backend_missing_required_config_is_an_error(capsys):
    rc, err = plan(capsys, "--attention-backend", "sliding_tile_attn")
    assert rc == 2 and err.startswith("error: ") and "mask_strategy_file_path" in err


def test_dit_global_backend_is_strict(capsys):
    # sol_attn needs bfloat16: the DiT's self-attention cannot use it in float32 -> fail closed
    rc, err = plan(capsys, "--attention-backend", "sol_attn")
    assert rc == 2 and "sol_attn" in err and "bfloat16" in err
    rc, p = plan(capsys, "--attention-backend", "sol_attn", "--dtype", "bfloat16")
    assert rc == 0 and summary(p, "transformer", "self") == {("sol_attn", "cli")}


def test_text_encoder_fa_refused_for_its_bias(capsys):
    # even on a GPU where fa runs, UMT5's relative-position bias rules it out
    rc, err = plan(capsys, "--component-attention-backends", "text_encoder=fa", platform=H200_FA4)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "text_encoder" in err and "additive attention bias" in err
    # a bias-capable backend is accepted
    rc, p = plan(capsys, "--component-attention-backends", "text_encoder=torch_sdpa", platform=H200_FA4)
    assert rc == 0 and summary(p, "text_encoder", "self") == {("torch_sdpa", "component")}


def test_global_fa_on_gpu(capsys):
    rc, p = plan(capsys, "--attention-backend", "fa", platform=H200_FA4)
    assert rc == 0
    assert p["platform"]["name"] == "cuda" and p["platform"]["capability"] == [9, 0]
    assert summary(p, "transformer", "self") == {("fa", "cli")}
    assert summary(p, "transformer", "cross") == {("fa", "cli")}
    te = layers(p, "text_encoder")
    assert {l["backend"] for l in te} == {"torch_sdpa"} and all("bias" in l["fallback_reason"] for l in te)
    # no FlashAttention runtime installed: the platform substitutes torch_sdpa and the plan says so
    rc, p = plan(capsys, "--attention-backend", "fa", platform=H200_BARE)
    assert rc == 0
    for l in layers(p, "transformer"):
        assert l["backend"] == "torch_sdpa" and l["source"] == "cli"
        assert l["fallback_reason"].startswith("fa -> torch_sdpa")


def test_vae_override_refused(capsys):
    rc, err = plan(capsys, "--component-attention-backends", "vae=torch_sdpa")
    assert rc == 2 and "'vae' has fixed attention" in err


def test_unknown_component_refused(capsys):
    rc, err = plan(capsys, "--component-attention-backends", "unet=torch_sdpa")
    assert rc == 2 and "unknown component 'unet'" in err and "transformer" in err
    # tiny-wan has no low-noise expert
    rc, err = plan(capsys, "--component-attention-backends", "transformer_2=torch_sdpa")
    assert rc == 2 and "unknown component 'transformer_2'" in err


def test_unused_override_refused(capsys):
    rc, err = plan(capsys, "--component-attention-backends", "text_encoder.cross=torch_sdpa")
    assert rc == 2 and "was not used" in err and "cross-attention" in err


def test_role_keys(capsys):
    rc, p = plan(capsys, "--component-attention-backends", "transformer.cross=sage_attn,transformer=torch_sdpa")
    assert rc == 0
    assert summary(p, "transformer", "cross") == {("sage_attn", "component_role")}
    assert summary(p, "transformer", "self") == {("torch_sdpa", "component")}
    # JSON form, and a role key beats the global backend
    spec = json.dumps({"transformer.self": "video_sparse_attn"})
    rc, p = plan(capsys, "--component-attention-backends", spec, "--attention-backend", "sage_attn")
    assert rc == 0
    assert summary(p, "transformer", "self") == {("video_sparse_attn", "component_role")}
    assert summary(p, "transformer", "cross") == {("sage_attn", "cli")}


def test_sparse_component_override_on_cross_falls_back(capsys):
    rc, p = plan(
        capsys, "--component-attention-backends", "transformer=video_sparse_attn", "--attention-backend", "sage_attn"
    )
    assert rc == 0
    assert summary(p, "transformer", "self") == {("video_sparse_attn", "component")}
    cross = layers(p, "transformer", "cross")
    assert {l["backend"] for l in cross} == {"sage_attn"}  # the compatible dense CLI backend
    assert all("cannot serve cross-attention" in l["fallback_reason"] for l in cross)


def test_sparse_role_override_on_cross_is_swapped_for_dense(capsys, caplog):
    """The seed: an incompatible override fails except when a sparse backend for cross-attention is
    swapped for a compatible dense one (this used to exit with an error)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="ditattn.attention"):
        rc, p = plan(capsys, "--component-attention-backends", "transformer.cross=video_sparse_attn")
    assert rc == 0
    cross = layers(p, "transformer", "cross")
    assert {(l["backend"], l["source"], l["requested"]) for l in cross} == {
        ("torch_sdpa", "component_role", "video_sparse_attn")
    }
    assert all("cannot serve cross-attention" in l["fallback_reason"] for l in cross)
    assert summary(p, "transformer", "self") == {("torch_sdpa", "auto")}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "video_sparse_attn" in r.getMessage()]
    assert len(warned) == 1 and "cross-attention" in warned[0].getMessage()  # once per component and role


def test_explicit_role_override_is_strict(capsys):
    rc, err = plan(capsys, "--component-attention-backends", "transformer.cross=sage_attn_3")
    assert rc == 2 and "sage_attn_3" in err and "cross" in err


def test_transformer_2_inherits_unless_it_has_its_own(capsys):
    rc, p = plan(
        capsys,
        "--model-path",
        "ditattn:tiny-wan2.2",
        "--component-attention-backends",
        "transformer=video_sparse_attn",
    )
    assert rc == 0
    assert [c["name"] for c in p["components"]] == ["text_encoder", "transformer", "transformer_2", "vae"]
    for comp in ("transformer", "transformer_2"):
        assert summary(p, comp, "self") == {("video_sparse_attn", "component")}
        assert {l["backend"] for l in layers(p, comp, "cross")} == {"torch_sdpa"}
    rc, p = plan(
        capsys,
        "--model-path",
        "ditattn:tiny-wan2.2",
        "--component-attention-backends",
        "transformer=video_sparse_attn,transformer_2.cross=sage_attn",
    )
    assert rc == 0
    assert summary(p, "transformer", "self") == {("video_sparse_attn", "component")}
    # transformer_2's own key decides its cross-attention; its self-attention still inherits
    # transformer= (a role key used to cancel inheritance for the other role)
    assert summary(p, "transformer_2", "cross") == {("sage_attn", "component_role")}
    assert summary(p, "transformer_2", "self") == {("video_sparse_attn", "component")}
    rc, p = plan(
        capsys,
        "--model-path",
        "ditattn:tiny-wan2.2",
        "--component-attention-backends",
        "transformer=video_sparse_attn,transformer_2=sage_attn",
    )
    assert summary(p, "transformer_2", "self") == {("sage_attn", "component")}  # its own key beats inheritance


def test_config_keys_checked_against_backends_in_use(capsys):
    rc, p = plan(capsys, "--attention-backend", "video_sparse_attn", "--attention-backend-config", "sparsity=0.5")
    assert rc == 0
    rc, err = plan(capsys, "--attention-backend", "video_sparse_attn", "--attention-backend-config", "topk=0.5")
    assert rc == 2 and "topk" in err and "video_sparse_attn" in err
    rc, err = plan(capsys, "--attention-backend", "video_sparse_attn", "--attention-backend-config", "sparsity=2")
    assert rc == 2 and "sparsity" in err


def test_forced_backend_wins(capsys):
    from ditattn.attention.context import global_force_attn_backend_context_manager

    with global_force_attn_backend_context_manager("sage_attn"):
        rc, p = plan(capsys, "--attention-backend", "torch_sdpa", "--model-path", "ditattn:tiny-wan2.2")
        assert rc == 2 and "bias" in p  # a force is strict: UMT5's biased attention cannot run sage_attn
    with global_force_attn_backend_context_manager("torch_sdpa"):
        rc, p = plan(capsys, "--attention-backend", "sage_attn")
    assert rc == 0
    for comp in ("text_encoder", "transformer"):
        assert {(l["backend"], l["source"]) for l in layers(p, comp)} == {("torch_sdpa", "forced")}


def test_ring_degree_needs_lse_backends(capsys):
    rc, p = plan(capsys, "--num-gpus", "2", "--ring-degree", "2")
    assert rc == 0 and summary(p, "transformer", "self") == {("torch_sdpa", "auto")}
    rc, err = plan(capsys, "--num-gpus", "2", "--ring-degree", "2", "--attention-backend", "video_sparse_attn")
    assert rc == 2 and "LSE" in err
    rc, err = plan(capsys, "--num-gpus", "3")
    assert rc == 2 and "heads" in err


def test_request_override_validated_by_plan(capsys):
    rc, p = plan(capsys, "--attention-backend-override", "torch_sdpa")
    assert rc == 0 and p["request_override"] == "torch_sdpa"
    rc, err = plan(capsys, "--attention-backend", "video_sparse_attn", "--attention-backend-override", "torch_sdpa")
    assert rc == 2 and "sparse" in err


def test_human_plan_table(capsys):
    capsys.readouterr()
    assert main(["plan", "--model-path", "ditattn:tiny-wan2.2", "--attention-backend", "video_sparse_attn"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("platform: cpu")
    assert "transformer_2  self   2 (0-1)  video_sparse_attn" in out
    assert "fixed attention" in out
    assert "cannot serve cross-attention" in out  # the fallback reasons are listed


def test_plan_of_the_diffusers_backend(capsys):
    """--backend diffusers: the diffusers pipeline's layers as ditattn routes them
    (tests/pipelines/test_diffusers_integration.py has the details); diffusers' own names have no plan."""
    rc, err = plan(capsys, "--backend", "diffusers")
    assert rc == 0, err
    rc, err = plan(capsys, "--backend", "diffusers", "--attention-backend", "flash")
    assert rc == 2 and "'flash' is diffusers' own backend name" in err


def test_local_model_folder(capsys, tmp_path):
    from ditattn.models.tiny import tiny_model_path

    folder = tiny_model_path("ditattn:tiny-wan2.2")
    rc, p = plan(capsys, "--model-path", folder)
    assert rc == 0 and [c["name"] for c in p["components"]][2] == "transformer_2"
    rc, err = plan(capsys, "--model-path", str(tmp_path))
    assert rc == 2 and "no model_index.json" in err
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    rc, err = plan(capsys, "--model-path", str(tmp_path))
    assert rc == 2 and "'FluxPipeline' is not supported" in err
    rc, err = plan(capsys, "--model-path", "ditattn:tiny-flux")
    assert rc == 2 and "ditattn:tiny-wan, ditattn:tiny-wan2.2" in err


def test_plan_checks_size_and_names_flags_that_do_not_change_it(capsys):
    assert main(["plan", "--height", "65"]) == 2
    # (the first build of the tiny model may print a progress bar before; the error is the last line)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: height 65 is not supported")
    assert main(["plan", "--num-inference-steps", "3", "--seed", "5", "--height", "64", "--num-frames", "5"]) == 0
    out = capsys.readouterr()
    assert "note: --seed do not change the attention plan" in out.err
    sampling = [line for line in out.out.splitlines() if line.startswith("sampling:")]
    assert len(sampling) == 1 and ", 3 steps (DiT timesteps" in sampling[0]  # the steps shape the sampling line
