"""The Python pipeline API under concurrent calls and careless arguments: generate from several threads
at once gives each call the frames it would get alone (the VAE's causal cache is one call's at a time),
and both pipeline classes check seeds, guidance scales and list lengths with a clear error."""

import threading

import numpy as np
import pytest

import ditattn
from ditattn.errors import AttentionConfigError

KW = dict(height=32, width=48, num_frames=5, num_inference_steps=2)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    import os

    os.environ.setdefault("DITATTN_CACHE", str(tmp_path_factory.mktemp("cache")))
    return ditattn.WanPipeline.from_pretrained("ditattn:tiny-wan", attention_backend="torch_sdpa")


def test_concurrent_generate_calls_each_get_their_own_frames(pipe):
    alone = {i: pipe.generate(f"prompt {i}", seed=i, **KW).frames for i in range(4)}
    got, errors = {}, []

    def run(i):
        try:
            got[i] = pipe.generate(f"prompt {i}", seed=i, **KW).frames
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(4):
        assert got[i].shape == alone[i].shape, (i, got[i].shape)
        assert np.abs(got[i].astype(int) - alone[i].astype(int)).max() <= 1, i


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(seed=-5), r"seed(:| must be an) .*integer from 0"),
        (dict(guidance_scale=float("nan")), r"guidance_scale(:| must be a) .*number from 0 to 100"),
        (dict(negative_prompt=[]), "negative_prompt has 0 entries for 1 prompts"),
        (dict(seed=[]), "seed has 0 entries for 1 prompts"),
    ],
)
def test_both_pipeline_classes_check_their_arguments(pipe, kw, match):
    for p in (pipe, pipe.native):  # WanPipeline, and the WanPipelineNative the README also shows
        with pytest.raises(AttentionConfigError, match=match):
            p.generate("a", **KW, **kw)


def test_non_finite_latents_are_an_error_not_a_black_clip():
    """Non-finite weights (a broken LoRA or checkpoint) denoised to NaN and decoded into an all-black clip
    that was reported and saved as a result; the pipeline now stops before decoding, naming the cause."""
    import torch

    from ditattn.pipelines.wan import WanPipelineNative

    native = WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cpu", dtype="float32")
    good = native.generate("a fox", **KW)
    assert np.isfinite(good.latents.numpy()).all() and good.frames.std() > 0
    weight = next(p for n, p in native.components["transformer"].named_parameters() if n.endswith("weight"))
    with torch.no_grad():
        weight.view(-1)[0] = float("nan")
    with pytest.raises(AttentionConfigError, match="denoised latents hold NaN or inf values, so no frames"):
        native.generate("a fox", **KW)
