"""Loading and decoding show a progress bar on stderr, like denoising, when stderr is a terminal;
a pipe or a log file stays clean."""

import io
import sys

import pytest


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_load_and_decode_bars_on_a_terminal_only(monkeypatch, tty):
    from ditattn.pipelines.wan import WanPipelineNative

    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cpu")
    loaded = err.getvalue()
    res = pipe.generate("a red square", height=32, width=32, num_frames=5, num_inference_steps=1, seed=0)
    decoded = err.getvalue()[len(loaded) :]
    assert res.frames.shape[1] == 5
    if tty:
        assert "loading" in loaded and "component" in loaded
        assert "decoding" in decoded and "/2 " in decoded  # 5 frames = 2 latent frames, one decoder call each
    else:
        assert "loading" not in loaded and "decoding" not in decoded


def test_decode_bar_counts_the_decoder_calls(monkeypatch):
    import torch

    import ditattn.pipelines.loading as loading
    from ditattn.pipelines.wan import WanPipelineNative

    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n, self.closed = kw, 0, False
            bars.append(self)

        def update(self, k=1):
            self.n += k
            return True  # tqdm's update() returns True whenever it redraws

        def set_postfix_str(self, *a, **k):
            pass

        def close(self):
            self.closed = True

    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cpu")
    monkeypatch.setattr(loading, "progress_bar", lambda **kw: Bar(**kw))
    latents = torch.randn(1, pipe.components["vae"].config.z_dim, 3, 4, 4)
    frames = pipe.decode(latents, progress=True)
    (bar,) = bars
    assert bar.kw["desc"] == "decoding" and bar.kw["total"] == 3 and bar.n == 3 and bar.closed
    assert frames.shape[1] == 9  # 3 latent frames -> 1 + 2 * 4 frames
    # neither the bar's nor a stop check's return value may stand in for the decoder's output or input
    from ditattn.pipelines.latents import decode_latents

    quiet = pipe.decode(latents, progress=False)
    vae = pipe.components["vae"]
    checked = decode_latents(vae, latents, torch.device("cpu"), progress=True, check_stop=lambda: True)
    assert (frames == quiet).all() and (checked == quiet).all()
