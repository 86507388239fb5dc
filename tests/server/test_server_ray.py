"""``ditattn serve --replicas 2`` on a local Ray instance (the real CLI in a subprocess, two CPU
replicas of the tiny model, a real PostgreSQL job store and a shared output folder): one endpoint
serves image requests and video jobs (submitted, polled, downloaded whichever replica ran them), 50
concurrent mixed requests get no 5xx and no wrong backend, and killing the replica that runs a video
job leaves the job finished by the other replica (or failed with a reason), its file downloadable.
Select with ``-m ray``; skipped without ray or PostgreSQL."""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving import serve_flags, serve_process, serve_subprocess, wait_video

pytest.importorskip("ray", reason="ray is not installed (pip install 'ditattn[scale]')")
pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "ray-key"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(pg_server, tmp_path_factory):
    url = pg_server.fresh_db("ray" + uuid.uuid4().hex[:10])
    out = tmp_path_factory.mktemp("shared-out")
    log = tmp_path_factory.mktemp("ray-serve") / "serve.log"
    args = serve_flags(
        model_path="ditattn:tiny-wan",
        replicas=2,
        job_store=url,
        output_dir=out,
        job_lease_s=4,
        api_key=KEY,
        max_batch_size=4,
        max_queue=16,
        height=16,
        width=16,
        num_inference_steps=2,
        guidance_scale=1.0,
        num_frames=5,
        max_output_pixels=64 * 64 * 41,  # test_sigterm_hands_the_running_job_back's long job
    )
    with serve_subprocess(args, log, startup_s=400) as (base, proc):
        yield base, url, out, log, proc


def _client(base):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _owner(url, vid):
    import psycopg

    with psycopg.connect(url) as c:
        return c.execute("SELECT owner, attempts, status FROM ditattn_videos WHERE id = %s", (vid,)).fetchone()


def _ran_on(url, vid):
    """The replica that claimed job ``vid`` last."""
    import psycopg

    with psycopg.connect(url) as c:
        return c.execute("SELECT ran_on FROM ditattn_videos WHERE id = %s", (vid,)).fetchone()[0]


def test_images_and_video_jobs_through_one_endpoint(cluster):
    base, url, out, _, _ = cluster
    c = _client(base)
    r = c.images.generate(
        prompt="a fox", n=2, size="16x16", extra_body={"seed": 3, "attention_backend_override": "torch_sdpa"}
    )
    assert len(r.data) == 2 and r.attention_backends == ["torch_sdpa"] and r.size == "16x16"
    u = c.images.generate(prompt="a cat", size="16x16", response_format="url").data[0].url
    assert all(httpx.get(base + u, headers=H).status_code == 200 for _ in range(4))  # whichever replica answers
    vids = [c.videos.create(prompt=f"clip {i}", size="16x16", extra_body={"seed": i}).id for i in range(3)]
    for vid in vids:
        v = wait_video(c, vid, timeout=240, poll=0.3)
        assert v.status == "completed", v
        got = httpx.get(f"{base}/v1/videos/{vid}/content", headers=H, timeout=60)
        assert got.status_code == 200 and got.content[4:8] == b"ftyp"
        assert (out / "videos" / f"{vid}.mp4").read_bytes() == got.content
        assert _owner(url, vid) == (None, 1, "completed")
    assert {v.id for v in c.videos.list(limit=50).data} >= set(vids)
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def _parents() -> dict:
    """``{pid: parent pid}`` of every process (from ``/proc``)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                out[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    return out


def _tree(root: int, parents: dict) -> set:
    """``root`` and every process below it (``parents``: :func:`_parents`): this deployment's Ray processes, not
    another Ray instance's on the machine (a concurrent test run, a user's own cluster)."""
    tree = {root}
    grew = True
    while grew:
        new = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _ray_worker_niceness(title: str, root: int) -> dict:
    """``{pid: [niceness of each thread]}`` of the processes below ``root`` whose title starts with ``ray::`` +
    ``title``."""
    out = {}
    for pid in map(str, _tree(root, _parents())):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::" + title.encode()):
                    continue
            out[int(pid)] = [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")]
        except (OSError, ProcessLookupError):
            continue  # a process or thread that ended meanwhile
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_replicas_and_proxy_run_at_niceness_0(cluster):
    """Ray's default would start them at 15, behind every other process of the node."""
    root = cluster[4].pid
    replicas = _ray_worker_niceness("ServeReplica:ditattn:DitReplica", root)
    proxy = _ray_worker_niceness("ProxyActor", root)
    assert len(replicas) == 2 and len(proxy) == 1, (replicas, proxy)
    assert {n for threads in [*replicas.values(), *proxy.values()] for n in threads} == {0}
    # each replica runs its pipeline in a process of its own (--replica-process, the default), at niceness 0 too
    hosts = _pipeline_processes(root)
    assert sorted(hosts.values()) == sorted(replicas), (hosts, replicas)
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in hosts} == {0}


def test_50_concurrent_mixed_requests(cluster):
    base, url, _, _, _ = cluster

    def one(i):
        kind = i % 5
        with httpx.Client(base_url=base, headers=H, timeout=300) as h:
            if kind == 0:
                r = h.post("/v1/videos", json={"prompt": f"v{i}", "size": "16x16", "seed": i})
                return kind, r.status_code, None, r
            if kind == 1:
                return kind, h.get("/v1/models").status_code, None, None
            override = "torch_sdpa" if kind == 2 else None
            body = {"prompt": f"p{i}", "size": "16x16", "seed": i, "n": 1 + i % 2}
            if override:
                body["attention_backend_override"] = override
            r = h.post("/v1/images/generations", json=body)
            r.sent_n = body["n"]
            return kind, r.status_code, override, r

    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    assert time.time() - t0 < 400
    codes = [code for _, code, _, _ in results]
    assert not [code for code in codes if code >= 500], codes
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 40, codes
    for kind, code, override, r in results:
        if kind in (2, 3, 4) and code == 200:
            backends = r.json()["attention_backends"]
            assert r.headers["x-ditattn-attention-backend"] == ",".join(backends)
            if override:
                assert backends == [override]
            assert len(r.json()["data"]) == r.sent_n
    c = _client(base)
    owners = set()
    for kind, code, _, r in results:
        if kind == 0 and code == 200:
            assert wait_video(c, r.json()["id"], timeout=300, poll=0.3).status == "completed"
            owners.add(_ran_on(url, r.json()["id"]))
    assert len(owners) == 2, owners  # the video jobs went to both replicas


def _running(c, url, vid) -> tuple:
    """``(owner, progress)`` once video ``vid`` is well under way (its progress reaches the store with the lease
    heartbeat)."""
    t0 = time.time()
    while True:
        owner, _, status = _owner(url, vid)
        progress = c.videos.retrieve(vid).progress  # the replica that answers: its own or the stored progress
        if owner and status == "in_progress" and progress >= 5:
            return owner, progress
        assert status in ("queued", "in_progress") and time.time() - t0 < 120, (owner, status)
        time.sleep(0.1)


def _long_video(c, prompt: str, seed: int) -> str:
    """A 100-step 32x32 video job (several seconds on the CPU replicas): its id."""
    return c.videos.create(
        prompt=prompt, size="32x32", extra_body={"num_inference_steps": 100, "seed": seed, "num_frames": 9}
    ).id


def test_killing_the_replica_that_runs_a_video_job(cluster):
    base, url, out, log, _ = cluster
    c = _client(base)
    vid = _long_video(c, "survive", 9)
    owner, progress = _running(c, url, vid)
    pid = int(owner.split(":")[1])
    os.kill(pid, signal.SIGKILL)  # the replica dies mid-job
    killed = time.time()
    v = wait_video(c, vid, timeout=300, poll=0.3)
    print(f"(--job-lease-s 4) killed at {progress} %; the job ended {time.time() - killed:.1f} s later")
    _, attempts, status = _owner(url, vid)
    assert status == v.status
    print(f"killed replica pid {pid} running {vid}: the job ended {v.status} (attempts {attempts})")
    if v.status == "completed":
        assert attempts == 2 and _ran_on(url, vid) != owner
        got = httpx.get(f"{base}/v1/videos/{vid}/content", headers=H, timeout=60)
        assert got.status_code == 200 and got.content[4:8] == b"ftyp"
    else:
        assert v.status == "failed" and v.error.code == "lease_expired" and v.error.message, v
    assert vid in {x.id for x in c.videos.list(limit=100).data}  # no job lost


def test_killing_the_pipeline_process_of_a_video_job(cluster):
    """The replica lives on without its pipeline: it stops renewing the job's lease and claims no more, the other
    replica finishes the job, and Ray Serve's health check replaces the replica."""
    base, url, _, _, proc = cluster
    c = _client(base)
    vid = _long_video(c, "orphan", 5)
    owner, _ = _running(c, url, vid)
    replica = int(owner.split(":")[1])
    hosts = [p for p, parent in _pipeline_processes(proc.pid).items() if parent == replica]
    assert len(hosts) == 1, (replica, _pipeline_processes(proc.pid))
    os.kill(hosts[0], signal.SIGKILL)
    v = wait_video(c, vid, timeout=300, poll=0.3)
    _, attempts, status = _owner(url, vid)
    assert (v.status, status, attempts) == ("completed", "completed", 2) and _ran_on(url, vid) != owner, v
    got = httpx.get(f"{base}/v1/videos/{vid}/content", headers=H, timeout=60)
    assert got.status_code == 200 and got.content[4:8] == b"ftyp"
    t0 = time.time()  # Ray restarts the replica: two replicas, each with its pipeline process, again
    replicas = "ServeReplica:ditattn:DitReplica"
    while len(_ray_worker_niceness(replicas, proc.pid)) != 2 or len(_pipeline_processes(proc.pid)) != 2:
        assert time.time() - t0 < 180, (_ray_worker_niceness(replicas, proc.pid), _pipeline_processes(proc.pid))
        time.sleep(0.5)


def _pipeline_processes(root: int) -> dict:
    """``{pid: parent pid}`` of the replicas' pipeline processes (``python -m ditattn.server.pipehost``) below
    ``root``."""
    parents, out = _parents(), {}
    for pid in _tree(root, parents):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ditattn.server.pipehost" in f.read():
                    out[pid] = parents[pid]
        except OSError:
            continue  # a process that ended meanwhile
    return out


def test_sigterm_hands_the_running_job_back(cluster):
    """SIGTERM to ``serve --replicas 2`` while a video job runs: exit 0, the job back in the store as
    queued with no owner (the next deployment, or another one sharing the store, runs it).  The last test
    of the module's deployment (it stops it): the tests above share its Ray instance."""
    import psycopg

    base, url, _, log, proc = cluster
    t0 = time.time()
    vid = httpx.post(
        base + "/v1/videos",
        json={"prompt": "long", "size": "64x64", "num_inference_steps": 100, "num_frames": 41},
        headers=H,
        timeout=60,
    ).json()["id"]
    while httpx.get(f"{base}/v1/videos/{vid}", headers=H, timeout=60).json()["status"] != "in_progress":
        assert time.time() - t0 < 500
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(180) == 0, log.read_text()[-3000:]
    with psycopg.connect(url) as c:
        row = c.execute("SELECT status, owner FROM ditattn_videos WHERE id = %s", (vid,)).fetchone()
    assert row == ("queued", None), row
    assert "stopping the replicas" in log.read_text()


SP_BODY = {"prompt": "a red fox", "size": "32x48", "seed": 11, "num_inference_steps": 2, "response_format": "b64_json"}


@pytest.fixture(scope="module")
def sp_deployment(pg_server, tmp_path_factory):
    """``serve --ray-address local --num-gpus 2 --ulysses-degree 2`` on the CPU (one replica whose process leads
    a 2-rank gloo group) with small limits (``--max-batch-size 1 --max-queue 1``: the replica takes 2 x 1 + 2
    requests at once, the deployment queues 1 x 1 more at Ray's proxy), and the single-process server's answer
    to :data:`SP_BODY`, computed while the Ray instance and the replica start (it needs neither)."""
    from test_server_app import serve

    from ditattn.runconfig import ModelConfig, RunConfig
    from ditattn.server.runner import build_runner

    url = pg_server.fresh_db("sp" + uuid.uuid4().hex[:10])
    folder = tmp_path_factory.mktemp("sp-deployment")
    args = [
        "--model-path",
        "ditattn:tiny-wan",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--ray-address",
        "local",
        "--num-gpus",
        "2",
        "--ulysses-degree",
        "2",
        "--max-batch-size",
        "1",
        "--max-queue",
        "1",
        "--job-store",
        url,
        "--output-dir",
        str(folder / "out"),
    ]

    def single_process():
        runner = build_runner(
            RunConfig(model=ModelConfig(model_path="ditattn:tiny-wan", device="cpu", dtype="float32"))
        )
        with serve(runner) as (plain, _app):
            return httpx.post(plain + "/v1/images/generations", json=SP_BODY, timeout=300)

    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(single_process)
        with serve_process(args, folder / "serve.log", startup_s=400) as base:
            yield base, reference.result()


def test_replica_with_two_ranks_on_ray(sp_deployment):
    """``serve --ray-address local --num-gpus 2 --ulysses-degree 2`` on the CPU: one replica whose
    process leads a 2-rank gloo group answers an image request like the single-process pipeline."""
    import base64
    import io

    import imageio.v3 as iio
    import numpy as np

    base, one = sp_deployment
    r = httpx.post(base + "/v1/images/generations", json=SP_BODY, timeout=300)
    assert r.status_code == 200, r.text
    got = iio.imread(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).astype(int)
    assert one.status_code == 200, one.text
    ref = iio.imread(io.BytesIO(base64.b64decode(one.json()["data"][0]["b64_json"]))).astype(int)
    assert got.shape == ref.shape == (48, 32, 3) and ref.std() > 1
    assert np.abs(got - ref).max() <= 1
    assert r.json()["attention_backends"] == one.json()["attention_backends"]


def test_deployment_full_is_429_with_retry_after(sp_deployment):
    """Small limits (the replica takes 2 x 1 + 2 requests at once, the deployment queues 1 x 1 at Ray's proxy:
    :func:`sp_deployment`): a burst of slow image requests gets 429 with Retry-After for the excess, 200 for the
    rest, never a 5xx."""
    base, _ = sp_deployment

    def one(i):
        with httpx.Client(base_url=base, timeout=300) as h:
            return h.post(
                "/v1/images/generations",
                json={"prompt": f"p{i}", "size": "16x16", "seed": i, "num_inference_steps": 40},
            )

    with ThreadPoolExecutor(24) as pool:
        rs = list(pool.map(one, range(24)))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    assert codes.count(200) <= 1 * 4 + 1 + 4  # replicas x (2 x batch + 2) in flight + the queue (+ the ones done)
    assert all(int(r.headers["retry-after"]) >= 1 for r in rs if r.status_code == 429)
