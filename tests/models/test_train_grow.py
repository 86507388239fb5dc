"""Growing a trained DiT (``--dit-layers``): the grown model computes what the package did, and trains."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def _tiny_dit(layers: int, seed: int = 0):
    from ditattn.train.dit_stage import build_transformer
    from ditattn.train.recipe import recipe

    dit = build_transformer(recipe("tiny").with_overrides(dit_layers=layers), seed)
    with torch.no_grad():  # build_transformer zeroes the output projection: give it weights to compare
        g = torch.Generator().manual_seed(seed + 7)
        dit.proj_out.weight.copy_(torch.randn(dit.proj_out.weight.shape, generator=g) * 0.1)
    return dit.eval()


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 3, 6, 10, generator=g)  # odd frames, non-square latent grid
    return x, torch.tensor([130.0, 870.0]), torch.randn(2, 5, 32, generator=g)


@pytest.mark.parametrize("old, new", [(2, 5), (3, 4), (1, 3)])
def test_grown_dit_computes_what_the_trained_one_did(old, new):
    from ditattn.train.dit_stage import grow_blocks

    dit = _tiny_dit(old)
    grown = grow_blocks(dit, new)
    assert len(grown.blocks) == new and grown.config.num_layers == new
    x, t, ctx = _inputs()
    with torch.no_grad():
        assert torch.equal(dit(x, t, ctx).sample, grown(x, t, ctx).sample)
    # each trained block is kept in order; each added one copies its inputs' projections from a trained block
    # and has zeroed output projections
    kept = [b for b in grown.blocks if b.ffn.net[2].weight.abs().sum() > 0]
    added = [b for b in grown.blocks if b.ffn.net[2].weight.abs().sum() == 0]
    assert len(kept) == old and len(added) == new - old
    for a, b in zip(kept, dit.blocks):
        assert torch.equal(a.attn1.to_q.weight, b.attn1.to_q.weight)
    sources = [b.attn1.to_q.weight for b in dit.blocks]
    for b in added:
        assert any(torch.equal(b.attn1.to_q.weight, s) for s in sources)
        assert b.attn1.to_out[0].weight.abs().sum() == 0 and b.attn2.to_out[0].weight.abs().sum() == 0


def test_grown_blocks_train_away_from_the_identity():
    from ditattn.train.dit_stage import grow_blocks

    grown = grow_blocks(_tiny_dit(2), 3).train()
    opt = torch.optim.SGD(grown.parameters(), lr=0.1)
    x, t, ctx = _inputs(3)
    loss = (grown(x, t, ctx).sample - torch.randn_like(x)).pow(2).mean()
    loss.backward()
    opt.step()
    added = grown.blocks[2]  # 2 -> 3 adds a copy of block 1 right after it
    assert added.ffn.net[2].weight.abs().sum() > 0 and added.attn1.to_out[0].weight.abs().sum() > 0


def test_cannot_grow_to_fewer_blocks():
    from ditattn.train.dit_stage import grow_blocks

    with pytest.raises(ValueError, match="has 3 blocks; cannot grow it to 2"):
        grow_blocks(_tiny_dit(3), 2)


def _train(out, *extra):
    from ditattn.train.shapes import main

    return main(
        ["--preset", "tiny", "--out", str(out), "--device", "cpu", "--threads", "1", "--eval-prompts", "0", *extra]
    )


def test_training_cli_grows_a_resumed_package(tmp_path, capsys):
    """--dit-layers with --resume: the package is grown, trained, saved with its new depth and loadable by
    the native pipeline; fewer blocks than the package's are refused with the reason."""
    from safetensors.torch import load_file

    base, grown = tmp_path / "base", tmp_path / "grown"
    assert _train(base, "--stage", "all", "--vae-steps", "1", "--dit-steps", "1", "--tune-guidance", "off") == 0
    assert (
        _train(
            grown,
            "--stage",
            "dit",
            "--dit-steps",
            "1",
            "--resume",
            str(base),
            "--dit-layers",
            "3",
            "--tune-guidance",
            "off",
        )
        == 0
    )
    meta = json.loads((grown / "shapes.json").read_text())
    assert meta["components"]["transformer"]["num_layers"] == 3
    keys = load_file(str(grown / "shapes.safetensors")).keys()
    assert "transformer.blocks.2.ffn.net.2.weight" in keys and "transformer.blocks.3.ffn.net.2.weight" not in keys
    assert "1 blocks grown to 3" in (grown / "train.log").read_text()

    from ditattn.models.shapes import shapes_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(
        shapes_model_path(root=str(tmp_path / "cache"), package=str(grown)), device="cpu"
    )
    res = pipe.generate(
        "a red circle moving right", height=32, width=32, num_frames=5, num_inference_steps=2, progress=False
    )
    assert res.frames.shape == (1, 5, 32, 32, 3)

    # growing again from the 3-block package to 2 blocks: refused, saying why
    capsys.readouterr()
    rc = _train(tmp_path / "shrunk", "--stage", "dit", "--dit-steps", "1", "--resume", str(grown), "--dit-layers", "2")
    err = capsys.readouterr().err
    assert rc == 2 and "num_layers 3 vs 2" in err and "--dit-layers only adds blocks" in err


def test_dit_layers_flag_is_checked(tmp_path, capsys):
    from ditattn.train.shapes import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--stage", "dit", "--dit-steps", "1", "--dit-layers", "0"])
    assert exc.value.code == 2 and "--dit-layers must be >= 1, got 0" in capsys.readouterr().err
