"""The PostgreSQL job store against a real server (tests/pg.py): records round-trip in order, a
queued job is claimed by exactly one of several concurrent claimers, a job whose lease ran out is
claimed again (and fails with the reason once its attempts are used up), and results are written
only by the lease holder."""

from __future__ import annotations

import threading
import time
import uuid

import pytest


def _rec(status="queued", **kw):
    return {"id": "video_" + uuid.uuid4().hex, "status": status, "prompt": "p", **kw}


@pytest.fixture
def url(pg_server):
    return pg_server.fresh_db("t" + uuid.uuid4().hex[:12])


def _store(url, owner):
    from ditattn.server.pgstore import PgJobStore

    return PgJobStore(url, owner=owner)


def test_round_trip_order_update_delete(url):
    a = _store(url, "a")
    recs = [_rec() for _ in range(5)]
    for r in recs:
        a.save(r)
    a.save(dict(recs[1], status="failed", error={"code": "x", "message": "m"}))
    loaded = a.load()
    assert [r["id"] for r in loaded] == [r["id"] for r in recs]
    assert loaded[1]["status"] == "failed" and loaded[1]["error"]["code"] == "x"
    a.delete(recs[0]["id"])
    assert a.get(recs[0]["id"]) is None and len(a.load()) == 4
    assert a.update(dict(recs[0], status="completed")) == "gone"
    a.close()
    assert a.closed
    with pytest.raises(RuntimeError, match="closed"):
        a.save(_rec())


def test_bad_url_is_a_config_error():
    from ditattn.errors import AttentionConfigError
    from ditattn.server.jobstores import open_job_store

    with pytest.raises(AttentionConfigError, match="accepted: sqlite"):
        open_job_store("mysql://x", "/tmp")
    # without psycopg the refusal names the missing client library; with it, the unreachable server
    import importlib.util

    want = r"cannot use the database.*" if importlib.util.find_spec("psycopg") else r"needs psycopg 3: pip install"
    with pytest.raises(AttentionConfigError, match=want) as exc:
        open_job_store("postgresql://u:secret@127.0.0.1:1/db", "/tmp")
    assert "secret" not in str(exc.value)


def test_exactly_one_claimer_wins_each_job(url):
    jobs = [_rec() for _ in range(6)]
    seed = _store(url, "seed")
    for r in jobs:
        seed.save(r)
    stores = [_store(url, f"r{i}") for i in range(4)]
    got: dict = {}
    barrier = threading.Barrier(len(stores))

    def claimer(s):
        barrier.wait()
        while True:
            rec, failed = s.claim(lease_s=60, max_attempts=3)
            assert failed == []
            if rec is None:
                return
            got.setdefault(rec["id"], []).append(s.owner)

    threads = [threading.Thread(target=claimer, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == sorted(r["id"] for r in jobs)
    assert all(len(owners) == 1 for owners in got.values()), got
    for vid, owners in got.items():
        assert seed.owner_of(vid)[:2] == (owners[0], 1)
    # nothing more to claim while the leases live
    assert stores[0].claim(60, 3) == (None, [])
    for s in stores + [seed]:
        s.close()


def test_expired_lease_is_requeued_then_fails_after_attempts(url):
    a, b = _store(url, "a"), _store(url, "b")
    r = _rec()
    a.save(r)
    rec, _ = a.claim(lease_s=0.3, max_attempts=2)
    assert rec["id"] == r["id"]
    assert a.update(dict(rec, status="in_progress")) == "ok"
    assert b.claim(60, 2) == (None, [])  # the lease still holds
    assert a.renew([r["id"]], 0.3, {r["id"]: 40}) == set()
    assert b.get(r["id"])["progress"] == 40
    time.sleep(0.5)  # a stops renewing: its replica died
    rec, failed = b.claim(lease_s=0.3, max_attempts=2)
    assert rec["id"] == r["id"] and rec["status"] == "queued" and failed == []
    assert b.owner_of(r["id"])[:2] == ("b", 2)
    # the old owner lost it: its renewal says so and its late result is refused
    assert a.renew([r["id"]], 60, {}) == {r["id"]}
    assert a.update(dict(rec, status="completed", path="videos/x.mp4")) == "taken"
    assert b.get(r["id"])["status"] == "queued"
    time.sleep(0.5)  # b dies too: attempts used up -> failed with the reason
    rec, failed = a.claim(lease_s=60, max_attempts=2)
    assert rec is None and [f["id"] for f in failed] == [r["id"]]
    stored = a.get(r["id"])
    assert stored["status"] == "failed" and stored["error"]["code"] == "lease_expired"
    assert "2 attempt(s)" in stored["error"]["message"] and "on b" in stored["error"]["message"]
    assert a.claim(60, 2) == (None, [])
    a.close(), b.close()


def test_close_hands_unfinished_jobs_back(url):
    a, b = _store(url, "a"), _store(url, "b")
    r1, r2 = _rec(), _rec()
    a.save(r1), a.save(r2)
    rec, _ = a.claim(60, 3)
    a.update(dict(rec, status="in_progress"))
    done, _ = a.claim(60, 3)
    assert a.update(dict(done, status="completed", path="videos/y.mp4")) == "ok"
    a.close()  # a stops: its running job goes back to the queue at once
    assert b.get(r1["id"])["status"] == "queued" and b.get(r2["id"])["status"] == "completed"
    rec, _ = b.claim(60, 3)
    assert rec["id"] == r1["id"]
    assert b.waiting() == 1
    b.close()
