"""The tiny Wan pipeline under sequence parallelism (2 gloo ranks) against the single-process run.

* ``ditattn generate --num-gpus 2 --ulysses-degree 2`` through the CLI (spawned ranks, rank 0 writes);
* Ulysses 2 and ring 2 pipelines in one spawn, on a token count that needs padding (27 tokens);
* ``serve``'s relay: concurrent ``generate`` calls on rank 0 replayed in order on rank 1.
"""

import os
import threading
import time

import numpy as np
import torch

from ditattn import AttentionConfigError
from ditattn.attention.context import AttentionSettings
from ditattn.distributed import destroy_sequence_parallel, init_sequence_parallel
from ditattn.distributed.relay import PipelineRelay

# 9 frames at 48x48: latent grid 3x3x3 = 27 tokens (2 ranks: 14 each, one padding token)
GEN = dict(height=48, width=48, num_frames=9, num_inference_steps=2, seed=3)


def _pipe(settings):
    from ditattn.pipelines.wan import WanPipelineNative

    return WanPipelineNative.from_pretrained(None, settings, device="cpu", dtype="float32")


def _worker(groups, configs):
    out = {}
    pipe = None
    for u, r in configs:
        destroy_sequence_parallel()
        init_sequence_parallel(u, r)
        pipe = _pipe(AttentionSettings(ulysses_degree=u, ring_degree=r))
        res = pipe.generate("a red fox", output_type="float", progress=False, **GEN)
        out[f"U{u}R{r}"] = (res.frames, res.attention_backends)
    # serve's relay: two concurrent calls on rank 0 (one with a per-request override), replayed on rank 1
    relay = PipelineRelay(heartbeat_s=0.1)
    if groups.rank == 0:
        results = {}

        def call(name, **kw):
            results[name] = pipe.generate("a blue bird", output_type="float", progress=False, **GEN, **kw).frames

        with relay.leading(type(pipe)):
            time.sleep(0.4)  # idle: heartbeats flow
            threads = [
                threading.Thread(target=call, args=("plain",)),
                threading.Thread(target=call, args=("override",), kwargs={"override": "torch_sdpa"}),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            try:
                pipe.generate([], progress=False, **GEN)  # refused identically on every rank
            except AttentionConfigError as exc:
                results["refused"] = str(exc)
        out["relay"] = results
    else:
        out["relayed"] = relay.follow(pipe)
    return out


def _rank_target(rank, cfg):
    """What each launched rank runs: the real ``ditattn generate`` rank, then the extra checks."""
    from ditattn.entrypoints.generate import run_rank

    rc = run_rank(rank, cfg)
    groups = rank.groups
    res = _worker(groups, [(2, 1), (1, 2)])
    res["rc"] = rc
    torch.save(res, os.path.join(os.environ["DITATTN_TEST_RESULTS"], f"rank{groups.rank}.pt"))
    return rc


def test_generate_two_ranks_ulysses_and_ring_match_single_process(tmp_path, capfd, monkeypatch):
    """One spawn: ``ditattn generate --num-gpus 2 --ulysses-degree 2`` through the CLI, whose ranks
    then also run the Ulysses-2 and ring-2 pipelines and serve's relay."""
    import ditattn.entrypoints.generate as generate_mod
    from ditattn.cli import main

    out_dir, res_dir = tmp_path / "out", tmp_path / "res"
    res_dir.mkdir()
    common = [
        "generate",
        "--prompt",
        "a red fox",
        "--num-frames",
        "1",
        "--height",
        "48",
        "--width",
        "48",
        "--num-inference-steps",
        "2",
        "--output-path",
        str(out_dir),
    ]
    assert main(common + ["--output-file", "single.png"]) == 0
    pipe = _pipe(AttentionSettings())
    single = {
        p: pipe.generate(p, output_type="float", progress=False, **GEN).frames for p in ("a red fox", "a blue bird")
    }

    monkeypatch.setenv("DITATTN_TEST_RESULTS", str(res_dir))
    monkeypatch.setattr(generate_mod, "run_rank", _rank_target)  # what `generate --num-gpus 2` runs per rank
    assert main(common + ["--output-file", "u2.png", "--num-gpus", "2", "--ulysses-degree", "2"]) == 0

    # the CLI run: rank 0 alone printed and wrote, and the image equals the single-process one
    captured = capfd.readouterr()
    assert captured.out.count("saved:") == 2, captured.out
    assert sorted(os.listdir(out_dir)) == ["single.png", "u2.png"]
    import imageio.v3 as iio

    a = iio.imread(out_dir / "single.png").astype(int)
    b = iio.imread(out_dir / "u2.png").astype(int)
    assert a.shape == b.shape == (48, 48, 3) and a.std() > 1
    assert np.abs(a - b).max() <= 1

    res = [torch.load(res_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["rc"] for r in res] == [0, 0]
    ref = single["a red fox"]
    assert ref.shape == (1, 9, 48, 48, 3) and ref.std() > 0.01
    for rank_res in res:  # every rank computed the same video
        for u, r in [(2, 1), (1, 2)]:
            frames, backends = rank_res[f"U{u}R{r}"]
            assert frames.shape == ref.shape
            assert np.abs(frames - ref).max() < 1e-4, (u, r, np.abs(frames - ref).max())
            assert backends == ["torch_sdpa"]
    relay = res[0]["relay"]
    for name in ("plain", "override"):
        assert np.abs(relay[name] - single["a blue bird"]).max() < 1e-4, name
    assert "prompt" in relay["refused"]
    assert res[1]["relayed"] == 3  # both generations and the refused call, in order


def test_cli_refuses_bad_parallel_flags_before_spawning(capsys):
    from ditattn.cli import main

    assert main(["generate", "--prompt", "x", "--num-gpus", "4", "--ulysses-degree", "3"]) == 2
    assert "--ulysses-degree 3 does not divide --num-gpus 4" in capsys.readouterr().err
    # tiny-wan's DiT has 4 heads: Ulysses 3 is refused from its config, before any rank starts
    assert (
        main(
            [
                "generate",
                "--prompt",
                "x",
                "--num-gpus",
                "3",
                "--ulysses-degree",
                "3",
                "--model-path",
                "ditattn:tiny-wan",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "4 attention heads do not divide" in err and "1, 2, 4" in err
    # the default model, ditattn:shapes, has 2 heads
    assert main(["generate", "--prompt", "x", "--num-gpus", "3", "--ulysses-degree", "3"]) == 2
    err = capsys.readouterr().err
    assert "2 attention heads do not divide" in err and "1, 2 " in err
    assert err.strip().splitlines()[-1].startswith("error: ")  # one line, no traceback
    # ring with a sparse backend, or a ring-incapable request override: refused by the plan-only preflight
    assert (
        main(
            [
                "generate",
                "--prompt",
                "x",
                "--num-gpus",
                "2",
                "--ring-degree",
                "2",
                "--attention-backend",
                "video_sparse_attn",
            ]
        )
        == 2
    )
    assert "sparse backends run under Ulysses only" in capsys.readouterr().err
    assert main(["serve", "--num-gpus", "2", "--ring-degree", "2", "--attention-backend-override", "sage_attn_3"]) == 2
    assert "ring parallelism (ring degree 2) needs a backend that returns the softmax LSE" in capsys.readouterr().err
    assert main(["serve", "--num-gpus", "4", "--ulysses-degree", "2", "--ring-degree", "3"]) == 2
    assert "--ulysses-degree 2 × --ring-degree 3 = 6 does not equal --num-gpus 4" in capsys.readouterr().err
