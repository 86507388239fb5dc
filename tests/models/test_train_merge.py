"""``python -m ditattn.train.merge``: a DiT run and a decoder-only VAE run, both continued from one
package, joined into one package; packages whose latents differ are refused."""

import json

import pytest
import torch

pytest.importorskip("diffusers")


def _train(out, *extra):
    from ditattn.train.shapes import main

    argv = ["--preset", "tiny", "--out", str(out), "--device", "cpu", "--threads", "1", "--eval-prompts", "0"]
    return main([*argv, "--tune-guidance", "off", *extra])


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "shapes.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    base = root / "base"
    assert _train(base, "--stage", "all", "--vae-steps", "2", "--dit-steps", "2") == 0
    assert _train(root / "dit", "--stage", "dit", "--dit-steps", "2", "--seed", "5", "--resume", str(base)) == 0
    assert (
        _train(root / "dec", "--stage", "vae", "--vae-steps", "2", "--vae-train", "decoder", "--resume", str(base))
        == 0
    )
    assert _train(root / "vae_all", "--stage", "vae", "--vae-steps", "1", "--resume", str(base)) == 0
    return root


def test_merge_takes_the_dit_of_one_run_and_the_decoder_of_the_other(runs, capsys):
    from ditattn.train.merge import main

    assert main(["--dit", str(runs / "dit"), "--decoder", str(runs / "dec"), "--out", str(runs / "merged")]) == 0
    assert "merged:" in capsys.readouterr().out
    merged, dit, dec, base = (_tensors(runs / n) for n in ("merged", "dit", "dec", "base"))
    assert merged.keys() == dit.keys()
    for key, tensor in merged.items():
        assert torch.equal(tensor, dec[key] if key.startswith("vae.") else dit[key]), key
    # both runs really trained: the merged package differs from the base in the DiT and in the decoder
    assert any(not torch.equal(merged[k], base[k]) for k in merged if k.startswith("transformer."))
    assert any(not torch.equal(merged[k], base[k]) for k in merged if k.startswith("vae.decoder."))
    meta = json.loads((runs / "merged" / "shapes.json").read_text())
    assert meta["training"]["stages"]["vae"]["train_encoder"] is False
    assert meta["training"]["stages"]["dit"]["resumed"] is True and "merged" in meta["training"]

    from ditattn.models.shapes import build_components, read_meta

    modules = build_components(read_meta(str(runs / "merged")), merged)
    assert set(modules) >= {"text_encoder", "transformer", "vae"}


def test_merge_refuses_packages_whose_latents_differ(runs, capsys):
    """A VAE run that also trained the encoder, the two folders swapped, an encoder changed by one value
    under the same statistics, and a missing package: one error line each, nothing written."""
    import shutil

    from safetensors.torch import save_file

    from ditattn.train.merge import main

    def merge(decoder):
        rc = main(["--dit", str(runs / "dit"), "--decoder", str(runs / decoder), "--out", str(runs / "bad")])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and not (runs / "bad").exists()
        return err

    err = merge("vae_all")
    assert "is not a decoder-only run" in err and "--vae-train decoder" in err
    rc = main(["--dit", str(runs / "dec"), "--decoder", str(runs / "dit"), "--out", str(runs / "bad")])  # swapped
    assert rc == 2 and "dit is not a decoder-only run" in capsys.readouterr().err and not (runs / "bad").exists()

    shutil.copytree(runs / "dec", runs / "dec_stats")  # decoder-only, but other latent statistics
    meta = json.loads((runs / "dec_stats" / "shapes.json").read_text())
    meta["components"]["vae"]["latents_mean"][0] += 1.0
    (runs / "dec_stats" / "shapes.json").write_text(json.dumps(meta))
    err = merge("dec_stats")
    assert "the VAE configs differ (latents_mean)" in err and "--vae-train decoder" in err

    shutil.copytree(runs / "dec", runs / "dec_edit")
    tensors = _tensors(runs / "dec_edit")
    key = sorted(k for k in tensors if k.startswith("vae.encoder."))[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] += 1
    save_file(tensors, str(runs / "dec_edit" / "shapes.safetensors"), metadata={"format": "1"})
    assert f"the encoders differ (1 tensors, e.g. {key})" in merge("dec_edit")

    assert "missing" in merge("missing")
