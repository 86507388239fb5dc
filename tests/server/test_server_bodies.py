"""Request bodies through the app: JSON, multipart (Starlette's parser on python-multipart) and
url-encoded forms, the size limit, and malformed bodies as one OpenAI error each (no 500)."""

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ditattn.runconfig import ServerConfig
from ditattn.server.app import create_app
from ditattn.server.runner import BaseRunner, ModelDefaults
from ditattn.server.scheduler import GenerationResult


class FlatRunner(BaseRunner):
    """No DiT layers; frames filled with the job's seed."""

    def __init__(self):
        super().__init__("toy", [], defaults=ModelDefaults(width=32, height=16, num_frames=5, num_inference_steps=2))
        self.jobs = []

    def run_batch(self, jobs):
        self.jobs += jobs
        return [
            GenerationResult(np.full((j.n, j.num_frames, j.height, j.width, 3), j.seed % 256, np.uint8), ["x"])
            for j in jobs
        ]


@pytest.fixture
def app_client():
    runner = FlatRunner()
    app = create_app(runner, ServerConfig(batch_window_s=0.0, max_body_bytes=4096))
    with TestClient(app, base_url="http://localhost") as c:  # a Host name the server answers without a key
        yield c, runner


def test_multipart_video_job_with_nested_fields(app_client):
    c, runner = app_client
    r = c.post(
        "/v1/videos",
        files={
            "prompt": (None, "waves"),
            "seconds": (None, "1"),
            "seed": (None, "7"),
            "skip_softmax_params[threshold_scale_factor]": (None, "500"),
        },
    )
    # nested skip_softmax_params reached validation (a runner without DiT layers has nothing to skip: 400)
    assert r.status_code == 400 and "skip_softmax" in r.json()["error"]["message"], r.text
    r = c.post(
        "/v1/videos",
        files={"prompt": (None, "waves"), "seconds": (None, "1"), "seed": (None, "7"), "fps": (None, "8")},
    )
    assert r.status_code == 200, r.text
    assert r.json()["num_frames"] == 9 and r.json()["fps"] == 8  # 1 s at 8 fps, rounded to 1 + 4k
    r = c.post("/v1/videos", files={"prompt": (None, "x"), "input_reference": ("cat.png", b"\x89PNG", "image/png")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


def test_urlencoded_form_and_json(app_client):
    c, runner = app_client
    r = c.post("/v1/videos", data={"prompt": "waves", "num_frames": "5", "seed": "3"})
    assert r.status_code == 200 and r.json()["num_frames"] == 5, r.text
    r = c.post("/v1/images/generations", json={"prompt": "x", "seed": 4, "n": 2})
    assert r.status_code == 200 and len(r.json()["data"]) == 2


@pytest.mark.parametrize(
    "headers, body, status, words",
    [
        ({"content-type": "multipart/form-data"}, b"--x\r\n", 400, "malformed form body"),
        (
            {"content-type": "multipart/form-data; boundary=x"},
            b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--\r\n",
            400,
            "malformed form body",
        ),
        ({"content-type": "application/json"}, b"[1, 2]", 400, "must be a JSON object"),
        ({"content-type": "application/json"}, b"{nope", 400, "not valid JSON"),
        ({"content-type": "application/json"}, b"", 400, "empty request body"),
        ({"content-type": "application/json"}, b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "too large"),
    ],
)
def test_malformed_bodies_are_one_error_each(app_client, headers, body, status, words):
    c, _ = app_client
    r = c.post("/v1/videos", content=body, headers=headers)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
