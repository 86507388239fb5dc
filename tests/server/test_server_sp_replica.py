"""A scaled-out replica that owns several ranks keeps sequence parallelism inside it: the replica's
process is rank 0 of its own group (here 2 gloo ranks on the CPU, Ulysses 2 or ring 2), it relays
each pipeline call to the spawned rank, answers image requests through the server app, and its output
equals the single-process run.  Bad degree / cluster combinations are one clear error."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io

import httpx
import numpy as np
import pytest
from test_server_app import serve

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import ModelConfig, ParallelConfig, RunConfig
from ditattn.server.rayserve import check_cluster_fits, cpu_threads_per_gpu, cpus_per_replica_for, replica_resources
from ditattn.server.runner import build_runner, open_runner

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# 9 frames at 48x32: latent grid 3x3x2 = 18 tokens; an odd image size too (48x32 -> 3x2 = 6 tokens)
GEN = dict(height=48, width=32, num_frames=9, num_inference_steps=2, seed=5)
BODY = {"prompt": "a red fox", "size": "32x48", "seed": 11, "num_inference_steps": 2, "response_format": "b64_json"}


def _cfg(**parallel) -> RunConfig:
    return RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan", device="cpu", dtype="float32"),
        parallel=ParallelConfig(**parallel),
    )


def _answer(runner):
    """A float32 video from the runner's pipeline and one image request through the server app."""
    frames = runner.pipe.generate("a blue bird", output_type="float", progress=False, **GEN).frames
    with serve(runner, max_batch_size=2) as (base, _app):
        r = httpx.post(base + "/v1/images/generations", json=BODY, timeout=300)
    assert r.status_code == 200, r.text
    import imageio.v3 as iio

    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(frames, dtype=np.float64), iio.imread(io.BytesIO(png)).astype(int), r.json()


@pytest.fixture(scope="module")
def single():
    return _answer(build_runner(_cfg()))


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, {"ring_degree": 2}], ids=["ulysses2", "ring2"])
def test_two_rank_replica_matches_single_process(single, degrees):
    ref_frames, ref_img, ref_json = single
    with contextlib.ExitStack() as ranks:
        runner = open_runner(_cfg(num_gpus=2, **degrees), ranks)
        from ditattn.distributed import get_sequence_parallel

        sp = get_sequence_parallel()
        assert sp is not None and sp.world_size == 2  # this process is rank 0 of the replica's group
        frames, img, js = _answer(runner)
    from ditattn.distributed import get_sequence_parallel

    assert get_sequence_parallel() is None  # the replica's group is gone once it stops
    assert frames.shape == ref_frames.shape and ref_frames.std() > 0.01
    rel = np.linalg.norm(frames - ref_frames) / np.linalg.norm(ref_frames)
    assert rel <= 1e-5, rel
    assert img.shape == ref_img.shape == (48, 32, 3) and ref_img.std() > 1
    assert np.abs(img - ref_img).max() <= 1
    assert js["attention_backends"] == ref_json["attention_backends"]


def test_bad_combinations_are_one_clear_error():
    with pytest.raises(AttentionConfigError, match="ulysses"):
        _cfg(num_gpus=4, ulysses_degree=3).parallel.degrees()
    cfg = dataclasses.replace(_cfg(num_gpus=2), model=ModelConfig(model_path="ditattn:tiny-wan", device="cuda"))
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, replicas=3))
    check_cluster_fits(cfg, [4.0, 2.0])  # 2 + 1 groups of 2 GPUs
    with pytest.raises(AttentionConfigError, match=r"--replicas 3 x --num-gpus 2 does not fit.*at most 2") as e:
        check_cluster_fits(cfg, [3.0, 2.0])
    assert "\n" not in str(e.value)
    with pytest.raises(AttentionConfigError, match="at most 0"):
        check_cluster_fits(cfg, [0.0])  # --device cuda on a cluster without GPUs
    check_cluster_fits(_cfg(num_gpus=2), [0.0])  # CPU ranks (gloo): nothing to place
    assert replica_resources(cfg, 8.0) == {"num_gpus": 2, "num_cpus": 1}
    assert replica_resources(_cfg(num_gpus=2), 0.0, 2.0) == {"num_cpus": 2.0}


def test_cpu_replicas_share_the_cores():
    assert [cpus_per_replica_for(n, [2.0]) for n in (1, 2, 3)] == [2, 1, 1]
    assert cpus_per_replica_for(2, [16.0, 8.0]) == 12 and cpus_per_replica_for(1, [16.0, 8.0]) == 16
    assert cpus_per_replica_for(4, [16.0, 8.0]) == 6


def test_gpu_replica_threads_follow_the_cores_per_gpu():
    # Ray starts workers with OMP_NUM_THREADS=1: a GPU replica's torch threads come from the node's cores per GPU
    assert cpu_threads_per_gpu([(16.0, 1.0)]) == 16
    assert cpu_threads_per_gpu([(128.0, 8.0), (16.0, 2.0), (64.0, 0.0)]) == 8  # the leanest GPU node; CPU nodes aside
    assert cpu_threads_per_gpu([(4.0, 8.0)]) == 1
    assert cpu_threads_per_gpu([(32.0, 0.0)]) == 1 and cpu_threads_per_gpu([]) == 1
