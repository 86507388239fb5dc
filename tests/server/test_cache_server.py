"""The step cache per request in the server: concurrent requests with different cache settings each get
their own (they never share a batch or a state), the response reports it, bad settings are a 400 naming
the field, and the server's default applies to requests that leave the fields out."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server_app import serve

from ditattn.runconfig import CacheOptions, ModelConfig, RunConfig
from ditattn.server.runner import build_runner

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BODY = {"size": "48x32", "num_inference_steps": 6, "guidance_scale": 3.0}
# what each setting decides on any input (6 steps: step 0 and the last computed; at most 3 reuses in a row)
CASES = [
    ({"cache_backend": "teacache", "cache_backend_config": "threshold=1e6"}, "teacache", "CRRRCC"),
    ({"cache_backend": "first_block_cache", "cache_backend_config": {"threshold": 0}}, "first_block_cache", "CCCCCC"),
    ({"cache_backend": "none"}, None, None),
    (
        {"cache_backend": "teacache", "cache_backend_config": "threshold=1e6,max_consecutive_skips=1"},
        "teacache",
        "CRCRCC",
    ),
]


@pytest.fixture(scope="module")
def server():
    cfg = RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan", device="cpu", dtype="float32"),
        cache=CacheOptions(cache_backend="first_block_cache", cache_backend_config="threshold=1e6"),
    )
    with serve(build_runner(cfg), max_batch_size=4, batch_window_s=0.05) as (base, _app):
        yield base


def _post(base, extra):
    r = httpx.post(base + "/v1/images/generations", json={"prompt": "a fox", **BODY, **extra}, timeout=120)
    return r.status_code, r.json()


def test_concurrent_requests_keep_their_own_cache(server):
    picks = [CASES[i % len(CASES)] for i in range(12)]
    with ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda c: _post(server, {**c[0], "seed": 1}), picks))
    for (body, backend, trace), (status, res) in zip(picks, outs):
        assert status == 200, res
        if backend is None:
            assert res["cache"] is None
        else:
            assert res["cache"]["backend"] == backend and res["cache"]["trace"] == trace, (body, res["cache"])
    # the server's default (first_block_cache, threshold 1e6) for a request that names none
    status, res = _post(server, {})
    assert status == 200 and res["cache"]["backend"] == "first_block_cache" and res["cache"]["trace"] == "CRRRCC"


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"cache_backend": "nope"}, "cache_backend", "unknown cache backend"),
        ({"cache_backend": " "}, "cache_backend", "cache backend is empty"),  # not the default cache switched off
        ({"cache_backend": "teacache", "cache_backend_config": "threshold=-1"}, "cache_backend_config", "threshold"),
        ({"cache_backend": "teacache", "cache_backend_config": {"thresh": 1}}, "cache_backend_config", "thresh"),
        (
            {"cache_backend": "first_block_cache", "cache_backend_config": "fn_blocks=99"},
            "cache_backend_config",
            "fn_blocks",
        ),
        ({"cache_backend": "magcache"}, "cache_backend_config", "needs a calibration"),
    ],
)
def test_bad_cache_settings_are_400_naming_the_field(server, extra, field, words):
    status, res = _post(server, extra)
    assert status == 400, res
    err = res.get("error", res)
    assert err["param"] == field and words in err["message"], err
    assert _post(server, {"cache_backend": "none"})[0] == 200  # and the server keeps serving


def test_video_job_reports_its_cache(server):
    import time

    body = {
        "prompt": "a fox",
        "size": "48x32",
        "seconds": "1",
        "num_inference_steps": 6,
        "fps": 4,
        "cache_backend": "teacache",
        "cache_backend_config": "threshold=1e6",
    }
    r = httpx.post(server + "/v1/videos", json=body, timeout=60)
    assert r.status_code == 200, r.text
    vid = r.json()["id"]
    t0 = time.time()
    while (v := httpx.get(f"{server}/v1/videos/{vid}", timeout=30).json())["status"] in ("queued", "in_progress"):
        assert time.time() - t0 < 120
        time.sleep(0.1)
    assert v["status"] == "completed", v
    assert v["cache"]["backend"] == "teacache" and v["cache"]["trace"] == "CRRRCC"
    bad = httpx.post(
        server + "/v1/videos", json={**body, "cache_backend_config": "max_consecutive_skips=0"}, timeout=60
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_backend_config"


def test_the_servers_cache_is_checked_against_a_requests_steps():
    """A request whose step count leaves the server's own cache settings no step to reuse (serve
    --cache-backend-config start_step=4, a request of 3 steps) failed at run time with param null; it is a
    400 at admission naming num_inference_steps and the server's setting."""
    cfg = RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan", device="cpu", dtype="float32"),
        cache=CacheOptions(cache_backend="teacache", cache_backend_config="threshold=1e6,start_step=4"),
    )
    with serve(build_runner(cfg), max_batch_size=1) as (base, _app):
        status, res = _post(base, {"num_inference_steps": 3})
        err = res.get("error", res)
        assert status == 400 and err["param"] == "num_inference_steps", res
        assert "the server's step cache" in err["message"] and "start_step" in err["message"], err
        status, res = _post(base, {"num_inference_steps": 6})
        assert status == 200 and res["cache"]["backend"] == "teacache", res
        assert _post(base, {"num_inference_steps": 3, "cache_backend": "none"})[0] == 200
