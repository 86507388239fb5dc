"""Replicas sharing a PostgreSQL job store (a real server: tests/pg.py) and an output folder, in one
process: two apps on uvicorn with the toy runner of test_server_app (real attention validation,
fake generation).  A video job posted to one replica is run by a free one, polled and downloaded
through the other; a replica that dies while running a job (its heartbeat stops) loses the job to
the other one after the lease, and the file is there; a deleted job stops where it runs."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid

import httpx
import pytest
from test_server_app import ToyRunner, client

import serving

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@contextlib.contextmanager
def replica(runner, url, folder, name, **cfg):
    """A :class:`ClusterState` replica on uvicorn in a thread; yields (base_url, state)."""
    from ditattn.runconfig import ServerConfig
    from ditattn.server.app import create_app
    from ditattn.server.cluster import ClusterState

    config = ServerConfig(
        **{
            "batch_window_s": 0.0,
            "job_store": url,
            "output_dir": str(folder),
            "replicas": 2,
            "job_lease_s": 1.0,
            **cfg,
        }
    )
    state = ClusterState(runner, config, owner=name)
    app = create_app(runner, config, state=state)
    with serving.serve_app(app, config) as base:
        yield base, state


@pytest.fixture
def url(pg_server):
    return pg_server.fresh_db("c" + uuid.uuid4().hex[:12])


def _wait(pred, timeout=20.0, what="condition"):
    serving.wait_for(pred, timeout, what, poll=0.02)


def test_job_posted_to_one_replica_runs_on_a_free_one_and_is_served_by_both(url, tmp_path):
    ra, rb = ToyRunner(), ToyRunner()
    with replica(ra, url, tmp_path, "a") as (a, sa), replica(rb, url, tmp_path, "b") as (b, sb):
        ca, cb = client(a), client(b)
        vids = [ca.videos.create(prompt=f"clip {i}", size="32x16", extra_body={"seed": 7 + i}).id for i in range(4)]
        for vid in vids:
            v = serving.wait_video(cb, vid, timeout=30, poll=0.05)
            assert v.status == "completed", v
            body = httpx.get(f"{a}/v1/videos/{vid}/content").content  # downloadable from either replica
            assert body == httpx.get(f"{b}/v1/videos/{vid}/content").content and len(body) > 100
            assert sa.storage.is_complete(str(tmp_path / "videos" / f"{vid}.mp4"))
        ran = [p for batch in ra.batches + rb.batches for p, _ in batch]
        assert sorted(ran) == sorted(f"clip {i}" for i in range(4))  # each job ran exactly once
        listed = [v.id for v in cb.videos.list(limit=10, order="asc").data]
        assert listed == vids
        # images with response_format=url are served by any replica too
        r = ca.images.generate(prompt="x", response_format="url", size="32x16", extra_body={"seed": 1})
        got = httpx.get(b + r.data[0].url)
        assert got.status_code == 200 and got.content[:4] == b"\x89PNG" and got.headers["x-ditattn-attention-backend"]
        # delete through b: gone everywhere, file removed
        assert httpx.delete(f"{b}/v1/videos/{vids[0]}").status_code == 200
        assert httpx.get(f"{a}/v1/videos/{vids[0]}").status_code == 404
        assert not (tmp_path / "videos" / f"{vids[0]}.mp4").exists()


def test_replica_dies_mid_job_other_replica_finishes_it(url, tmp_path):
    gate = threading.Event()
    slow = ToyRunner(gate=gate)  # holds its batch: this replica "hangs" in the job, then dies
    fast = ToyRunner()
    with replica(slow, url, tmp_path, "a") as (a, sa):
        vid = client(a).videos.create(prompt="survives", size="32x16", extra_body={"seed": 5}).id
        _wait(lambda: sa.videos.jobs.owner_of(vid)[0] == "a", what="replica a to claim the job")
        sa._stop_beat.set()  # replica a dies: no heartbeat, no hand-back
        sa._wake.set()
        with replica(fast, url, tmp_path, "b") as (b, sb):
            v = serving.wait_video(client(b), vid, timeout=30, poll=0.05)
            assert v.status == "completed", v
            owner, attempts, status = sb.videos.jobs.owner_of(vid)
            assert (owner, attempts, status) == (None, 2, "completed")
            assert [p for batch in fast.batches for p, _ in batch] == ["survives"]
            got = httpx.get(f"{b}/v1/videos/{vid}/content")
            assert got.status_code == 200 and got.content[4:8] == b"ftyp"
            gate.set()  # the dead replica's late result is not recorded over b's
            _wait(lambda: slow.batches, what="replica a's late batch")
            time.sleep(0.3)
            assert sb.videos.jobs.get(vid)["status"] == "completed"
            assert httpx.get(f"{a}/v1/videos/{vid}/content").status_code == 200


def test_attempts_exhausted_fail_with_reason_and_video_queue_is_deployment_wide(url, tmp_path):
    gate = threading.Event()
    with replica(ToyRunner(gate=gate), url, tmp_path, "a", job_max_attempts=1, max_queue=1) as (a, sa):
        c = client(a)
        vid = c.videos.create(prompt="doomed", size="32x16").id
        _wait(lambda: sa.videos.jobs.owner_of(vid)[0] == "a", what="the claim")
        # the deployment's video queue holds replicas x max_queue = 2 waiting jobs; the next is a 429
        more = [c.videos.create(prompt=f"w{i}", size="32x16").id for i in range(2)]
        r = httpx.post(f"{a}/v1/videos", json={"prompt": "too many", "size": "32x16"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "queue_full"
        assert len(c.videos.list(limit=10).data) == 3  # the refused job was not kept
        sa._stop_beat.set()
        sa._wake.set()
        time.sleep(1.3)  # the lease of a runs out; one attempt allowed: the next claimer fails it
        from ditattn.server.pgstore import PgJobStore

        other = PgJobStore(url, owner="b")
        rec, failed = other.claim(60, 1)
        assert [f["id"] for f in failed] == [vid] and rec["id"] == more[0]
        v = c.videos.retrieve(vid)
        assert v.status == "failed" and v.error.code == "lease_expired" and "on a" in v.error.message
        other.close()
        gate.set()


def test_replica_refuses_without_shared_store(tmp_path):
    from ditattn.errors import AttentionConfigError
    from ditattn.runconfig import ServerConfig
    from ditattn.server.cluster import ClusterState

    with pytest.raises(AttentionConfigError, match="--job-store postgresql"):
        ClusterState(ToyRunner(), ServerConfig(output_dir=str(tmp_path), replicas=2))
    with pytest.raises(AttentionConfigError, match="--output-dir"):
        ClusterState(ToyRunner(), ServerConfig(job_store="postgresql://u@127.0.0.1:1/x", replicas=2))


def _serve_replicas_run(args, folder):
    import sys

    args = [folder if a == "OUT" else a for a in args]
    return dict(
        args=[sys.executable, "-m", "ditattn", "serve", "--port", str(serving.free_port()), *args],
        env=serving.subprocess_env(),
        timeout=120,
    )


def _refusal(args, match):  # the run in the background (tests/background.py): a subprocess and nothing else
    return pytest.param(
        args, match, marks=pytest.mark.background.with_args(functools.partial(_serve_replicas_run, args))
    )


@pytest.mark.parametrize(
    "args, match",
    [
        _refusal(["--replicas", "2"], "--replicas needs a job store the replicas share"),
        _refusal(
            ["--replicas", "2", "--job-store", "postgresql://u@127.0.0.1:1/x"], "--replicas needs an output folder"
        ),
        _refusal(
            ["--replicas", "2", "--job-store", "mysql://x", "--output-dir", "OUT"],
            "expected sqlite or a postgresql://",
        ),
    ],
)
def test_cli_refuses_replicas_without_shared_store(background_run, args, match):
    """``serve --replicas`` checks its shared store and folder before Ray starts: exit 2, one line."""
    r, _ = background_run
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and match in r.stderr, r.stderr


@pytest.mark.parametrize(
    "server, match",
    [
        ({"replicas": 2}, "a job store the replicas share"),
        ({"replicas": 2, "job_store": "postgresql://u@127.0.0.1:1/x"}, "an output folder"),
    ],
)
def test_missing_arguments_are_named_before_missing_packages(monkeypatch, server, match):
    """Without Ray or psycopg installed, ``serve --replicas`` still names the argument that is missing first
    (what to pass comes before what to install)."""
    from ditattn import extras
    from ditattn.entrypoints.serve import serve_on_ray
    from ditattn.errors import AttentionConfigError
    from ditattn.runconfig import RunConfig, ServerConfig

    def nothing_installed(extra, what):
        raise extras.MissingDependencyError(f"{what} needs the {extra} extra")

    monkeypatch.setattr(extras, "require", nothing_installed)
    with pytest.raises(AttentionConfigError, match=match):
        serve_on_ray(RunConfig(server=ServerConfig(**server)))


def test_complete_means_a_whole_mp4(tmp_path):
    """The shared folder calls an MP4 complete only when its top-level boxes end at the file's size."""
    import numpy as np

    from ditattn.server.media import write_mp4
    from ditattn.server.storage import SharedFolder

    folder = SharedFolder(str(tmp_path))
    path = folder.path("videos", "v.mp4")
    write_mp4(path, np.random.default_rng(0).integers(0, 255, (5, 16, 16, 3), dtype=np.uint8), 8)
    assert folder.is_complete(path)
    data = open(path, "rb").read()
    for cut in (len(data) - 1, len(data) // 2, 7, 0):
        bad = folder.path("videos", f"cut{cut}.mp4")
        open(bad, "wb").write(data[:cut])
        assert not folder.is_complete(bad), cut
    assert not folder.is_complete(folder.path("videos", "missing.mp4"))
    with pytest.raises(ValueError):
        folder.path("videos", "../x.mp4")


def test_completed_without_a_complete_file_is_failed(url, tmp_path):
    """A job whose MP4 is missing or cut short is stored failed (file_missing), never completed."""
    from ditattn.server.cluster import SharedVideoStore
    from ditattn.server.pgstore import PgJobStore
    from ditattn.server.storage import SharedFolder
    from ditattn.server.store import VideoRecord

    jobs = PgJobStore(url, owner="a")
    store = SharedVideoStore(10, jobs, str(tmp_path), SharedFolder(str(tmp_path)))
    rec = VideoRecord(
        id="video_" + uuid.uuid4().hex,
        model="m",
        prompt="p",
        size="16x16",
        seconds="1",
        num_frames=5,
        fps=8,
        num_inference_steps=2,
        override=None,
        skip_softmax=None,
        attention_backends=[],
        created_at=0,
    )
    store.add(rec)
    claimed, _ = jobs.claim(60, 3)
    store.adopt(VideoRecord.from_json(claimed, str(tmp_path)))
    path = str(tmp_path / "videos" / f"{rec.id}.mp4")
    open(path, "wb").write(b"\x00\x00\x00\x18ftypisom")  # cut short
    assert store.update(rec.id, status="completed", path=path) is not None
    stored = jobs.get(rec.id)
    assert stored["status"] == "failed" and stored["error"]["code"] == "file_missing" and stored["path"] is None
    jobs.close()


def test_metrics_of_any_replica_cover_the_deployment(url, tmp_path):
    """``/metrics`` at either replica holds every live replica's samples, labelled by replica (3 images
    made on a, 1 on b: both views say so, and their sum is the deployment's 4); a replica that stopped
    leaves the view."""
    from ditattn.server.metrics import samples

    def images(base):
        got = {}
        for name, labels, value in samples(httpx.get(base + "/metrics").content):
            if name == "ditattn_images_generated_total":
                got[labels["replica"]] = value
            if name == "ditattn_replicas_reporting":
                got["reporting"] = value
        return got

    with replica(ToyRunner(), url, tmp_path, "a") as (a, _sa):
        with replica(ToyRunner(), url, tmp_path, "b") as (b, _sb):
            for base, n in ((a, 2), (a, 1), (b, 1)):
                r = httpx.post(base + "/v1/images/generations", json={"prompt": "m", "size": "32x16", "n": n})
                assert r.status_code == 200, r.text
            _wait(lambda: images(a) == images(b) == {"a": 3.0, "b": 1.0, "reporting": 2.0}, what="both views")
            reqs = {
                (lab["replica"], lab["status"]): v
                for name, lab, v in samples(httpx.get(b + "/metrics").content)
                if name == "ditattn_http_requests_total" and lab["endpoint"] == "/v1/images/generations"
            }
            assert reqs == {("a", "200"): 2.0, ("b", "200"): 1.0}, reqs
        assert images(a) == {"a": 3.0, "reporting": 1.0}  # b stopped: gone from the view at once
