"""A CPU request that would take minutes is warned about, with the estimate, before denoising (not refused)."""

import pytest

from ditattn.pipelines.estimate import WARN_SECONDS, estimate


def _shapes(**kw):
    return estimate(layers=6, heads=2, head_dim=128, ffn_dim=512, **kw)


def test_estimate_counts_tokens_forwards_and_grows_with_the_request():
    small = _shapes(height=128, width=128, num_frames=17, steps=20, guidance=True)
    assert (small.tokens, small.forwards, small.layers) == (5 * 8 * 8, 40, 6)
    assert small.seconds < WARN_SECONDS  # the default run is not warned about
    assert _shapes(height=128, width=128, num_frames=17, steps=20, guidance=False).forwards == 20
    big = _shapes(height=2048, width=2048, num_frames=33, steps=20, guidance=True)
    assert big.tokens == 9 * 128 * 128 and big.seconds > 100 * WARN_SECONDS
    # attention is quadratic in the tokens: 4x the tokens is more than 4x the work
    wide = _shapes(height=256, width=256, num_frames=17, steps=20, guidance=True)
    assert wide.tokens == 4 * small.tokens and wide.dit_flops > 4 * small.dit_flops


def test_generate_warns_before_denoising_and_goes_on(capsys, monkeypatch, tmp_path):
    from ditattn.cli import main
    from ditattn.pipelines.wan import WanPipelineNative

    def stop(self, *a, **k):
        raise KeyboardInterrupt  # the warning must come before any step

    monkeypatch.setattr(WanPipelineNative, "generate", stop)
    rc = main(
        [
            "generate",
            "--model-path",
            "ditattn:tiny-wan",
            "--device",
            "cpu",
            "--prompt",
            "x",
            "--height",
            "2048",
            "--width",
            "2048",
            "--num-frames",
            "33",
            "--output-path",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 130  # not refused: it went on to generate
    (line,) = [x for x in err.splitlines() if x.startswith("warning:")]
    assert "2048x2048, 33 frames" in line and "tokens x" in line and " h here" in line


@pytest.mark.parametrize("argv", [["--num-frames", "1", "--height", "32", "--width", "32"]])
def test_small_requests_get_no_warning(capsys, tmp_path, argv):
    from ditattn.cli import main

    assert (
        main(
            [
                "generate",
                "--model-path",
                "ditattn:tiny-wan",
                "--device",
                "cpu",
                "--prompt",
                "x",
                "--num-inference-steps",
                "1",
                "--output-path",
                str(tmp_path),
                *argv,
            ]
        )
        == 0
    )
    assert "warning:" not in capsys.readouterr().err
