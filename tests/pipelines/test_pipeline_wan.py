"""The native Wan pipeline: parity with diffusers' WanPipeline, the denoise loop, batching, overrides."""

import numpy as np
import pytest
import torch

from ditattn.attention.context import AttentionSettings, current_forward
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.errors import AttentionConfigError
from ditattn.pipelines.wan import WanPipelineNative


@pytest.fixture(scope="module")
def pipe():
    return WanPipelineNative.from_pretrained("ditattn:tiny-wan")


@pytest.fixture(scope="module")
def pipe22():
    return WanPipelineNative.from_pretrained("ditattn:tiny-wan2.2")


def _diffusers(path):
    from diffusers import WanPipeline

    d = WanPipeline.from_pretrained(path)
    d.set_progress_bar_config(disable=True)
    return d


def _diffusers_run(ref, *args, **kw):
    """diffusers' frames plus its final latents (captured by a step-end callback)."""
    box = {}

    def grab(pipe, i, t, tensors):
        box["latents"] = tensors["latents"].clone()
        return {}

    frames = ref(*args, output_type="np", callback_on_step_end=grab, **kw).frames
    return frames, box["latents"]


def test_full_pipeline_matches_diffusers(pipe):
    """Wan 2.1 layout, classifier-free guidance, a video, the default 512-token text context."""
    ref = _diffusers(pipe.model_index.path)
    kw = dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=4.0)
    ours = pipe.generate("a red fox in the snow", "blurry", seed=3, output_type="float", progress=False, **kw)
    frames, latents = _diffusers_run(
        ref, "a red fox in the snow", "blurry", generator=torch.Generator().manual_seed(3), **kw
    )
    assert ours.frames.shape == frames.shape == (1, 5, 32, 48, 3)
    torch.testing.assert_close(ours.latents, latents, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours.frames, frames, rtol=0, atol=2e-5)


def test_wan22_pipeline_matches_diffusers(pipe22):
    """Wan 2.2 layout (two experts switched at the boundary), no guidance, one frame."""
    ref = _diffusers(pipe22.model_index.path)
    kw = dict(height=32, width=32, num_frames=1, num_inference_steps=3, guidance_scale=1.0, max_sequence_length=64)
    sched = pipe22.components["scheduler"]()
    sched.set_timesteps(3)
    ts = [float(t) for t in sched.timesteps]
    assert ts[0] >= 875 > ts[-1]  # both experts take part
    ours = pipe22.generate("sunset", seed=11, output_type="float", progress=False, **kw)
    frames, latents = _diffusers_run(ref, "sunset", generator=torch.Generator().manual_seed(11), **kw)
    torch.testing.assert_close(ours.latents, latents, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours.frames, frames, rtol=0, atol=2e-5)


def test_wan22_switches_expert_at_boundary(pipe22):
    calls = []
    hooks = [
        pipe22.components[name].register_forward_pre_hook(
            lambda m, args, name=name: calls.append((name, float(args[1].flatten()[0])))
        )
        for name in ("transformer", "transformer_2")
    ]
    try:
        pipe22.generate(
            "x",
            seed=0,
            progress=False,
            output_type="latent",
            height=16,
            width=16,
            num_frames=1,
            num_inference_steps=8,
            guidance_scale=3.0,
            max_sequence_length=32,
        )
    finally:
        for h in hooks:
            h.remove()
    boundary = pipe22.boundary_ratio * 1000
    assert pipe22.boundary_ratio == 0.875
    assert len(calls) == 8  # cond + uncond run as one batch per step
    assert all((n == "transformer") == (t >= boundary) for n, t in calls), calls
    assert {n for n, _ in calls} == {"transformer", "transformer_2"}
    assert [n for n, _ in calls] == sorted(n for n, _ in calls)  # high-noise expert first, then the low-noise one


def test_forward_context_per_step(pipe):
    seen = []

    def spy(mod, args):
        f = current_forward()
        seen.append((mod.prefix, f.step, f.num_steps, f.video_shape, f.text_len))

    layer_self = pipe.components["transformer"].blocks[1].attn1.attn
    layer_cross = pipe.components["transformer"].blocks[1].attn2.attn
    hooks = [layer_self.register_forward_pre_hook(spy), layer_cross.register_forward_pre_hook(spy)]
    try:
        pipe.generate(
            "x", height=32, width=64, num_frames=5, num_inference_steps=3, progress=False, output_type="latent"
        )
    finally:
        for h in hooks:
            h.remove()
    assert [s[1] for s in seen] == [0, 0, 1, 1, 2, 2]
    assert all(s[2] == 3 and s[3] == (2, 2, 4) and s[4] == 0 for s in seen)
    assert current_forward().step is None  # nothing leaks out of the run


def test_batch_of_prompts_is_independent_of_batching(pipe):
    kw = dict(
        height=32,
        width=32,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=5.0,
        progress=False,
        output_type="float",
    )
    both = pipe.generate(["a cat", "a dog"], ["", "dark"], seed=[5, 7], **kw)
    alone = pipe.generate("a dog", "dark", seed=7, **kw)
    assert both.frames.shape == (2, 1, 32, 32, 3)
    np.testing.assert_allclose(both.frames[1], alone.frames[0], atol=1e-5)
    assert not np.allclose(both.frames[0], both.frames[1])
    u8 = pipe(["a cat", "a dog"], ["", "dark"], seed=[5, 7], **{**kw, "output_type": "uint8"})
    assert u8.dtype == np.uint8 and u8.shape == (2, 1, 32, 32, 3)
    # an int seed gives prompt i the seed + i
    assert pipe.generate(["a", "b"], seed=9, **kw).seeds == [9, 10]


def test_request_override_switches_every_dit_layer(pipe, monkeypatch):
    import ditattn.attention.override as ov

    calls = []
    real = ov.get_impl

    def counting(backend):
        impl = real(backend)

        def wrapped(q, k, v, call, config):
            calls.append((backend.value, call.layer_key))
            return impl(q, k, v, call, config)

        return wrapped

    monkeypatch.setattr(ov, "get_impl", counting)
    kw = dict(height=16, width=16, num_frames=1, num_inference_steps=2, progress=False, output_type="float")
    base = pipe.generate("x", **kw)
    res = pipe.generate("x", override="torch_sdpa", **kw)
    assert res.attention_backends == ["torch_sdpa"]
    np.testing.assert_allclose(res.frames, base.frames, atol=1e-6)
    # 4 DiT layers x 2 steps, all through the request table; the text encoder is not switched
    assert len(calls) == 8 and {k for _, k in calls} == {
        "transformer.blocks.0.attn1",
        "transformer.blocks.0.attn2",
        "transformer.blocks.1.attn1",
        "transformer.blocks.1.attn2",
    }
    calls.clear()
    pipe.generate("x", **kw)  # the next request without an override runs the default
    assert calls == []


def test_request_override_refusals(pipe):
    with pytest.raises(AttentionConfigError, match="not a per-request drop-in"):
        pipe.generate("x", override="video_sparse_attn", progress=False)
    with pytest.raises(AttentionConfigError, match="unknown attention backend"):
        pipe.generate("x", override="nope", progress=False)
    with pytest.raises(AttentionConfigError, match="fa"):
        pipe.generate("x", override="fa", progress=False)  # no FlashAttention on CPU: refused, never substituted


def test_bad_requests_are_clear_errors(pipe):
    with pytest.raises(AttentionConfigError, match="height 40 .*multiples of 16"):
        pipe.generate("x", height=40, progress=False)
    with pytest.raises(AttentionConfigError, match=r"num_frames 4 .*1 \+ 4k"):
        pipe.generate("x", num_frames=4, progress=False)
    with pytest.raises(AttentionConfigError, match="negative_prompt has 1 entries for 2 prompts"):
        pipe.generate(["a", "b"], ["n"], progress=False)
    with pytest.raises(AttentionConfigError, match="positive integer"):
        pipe.generate("x", num_inference_steps=0, progress=False)
    plan_only = WanPipelineNative.from_pretrained("ditattn:tiny-wan", load_weights=False)
    with pytest.raises(AttentionConfigError, match="plan only"):
        plan_only.generate("x")


def test_sparse_backend_runs_end_to_end():
    """A global sparse backend serves the DiT self-attention (with the step/grid metadata) and
    cross-attention falls back to dense, through a whole generation."""
    p = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", AttentionSettings(backend=B.VIDEO_SPARSE_ATTN, config={"sparsity": 0.5})
    )
    assert p.dit_backends() == ["video_sparse_attn", "torch_sdpa"]
    res = p.generate(
        "x", height=64, width=64, num_frames=5, num_inference_steps=2, progress=False, output_type="latent"
    )
    assert res.attention_backends == ["video_sparse_attn", "torch_sdpa"]
    assert res.frames.shape == (1, 16, 2, 8, 8) and torch.isfinite(res.frames).all()


def test_should_stop_ends_the_run_between_steps(pipe):
    """The cancellation hook a server passes: asked before the text encoder, each step and
    the decode; a reason stops the run there with GenerationCancelled and nothing is decoded."""
    from ditattn.distributed.relay import PipelineRelay
    from ditattn.errors import GenerationCancelled

    steps_done, asked = [], []

    def stop_after_two():
        asked.append(len(steps_done))
        return "deleted" if len(steps_done) >= 2 else None

    with pytest.raises(GenerationCancelled, match="generation stopped: deleted") as ei:
        pipe.generate(
            "x",
            height=32,
            width=32,
            num_frames=1,
            num_inference_steps=6,
            progress=False,
            on_step=lambda done, total: steps_done.append(done),
            should_stop=stop_after_two,
        )
    assert ei.value.reason == "deleted" and steps_done == [1, 2] and asked[-1] == 2
    with pytest.raises(GenerationCancelled):  # stopped before the text encoder already
        pipe.generate(
            "x",
            height=32,
            width=32,
            num_frames=1,
            num_inference_steps=2,
            progress=False,
            should_stop=lambda: "timeout",
        )
    res = pipe.generate(
        "x", height=32, width=32, num_frames=1, num_inference_steps=2, progress=False, should_stop=lambda: None
    )
    assert res.frames.shape == (1, 1, 32, 32, 3)
    # sequence parallelism relays calls to other ranks: the callable is never sent
    msg = PipelineRelay.describe_call(("x",), {"should_stop": stop_after_two, "on_step": print, "seed": 1})
    assert msg["kwargs"] == {"seed": 1}
