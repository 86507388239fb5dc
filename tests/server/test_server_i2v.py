"""Image-to-video and LoRA through the server: ``ditattn serve`` of the tiny Wan 2.1 I2V model end to end
(the official ``openai`` client uploading ``input_reference``, a plain HTTP multipart request, a JSON body
with a base64 data URL, per-request ``lora``), and every refusal of a bad reference image or LoRA."""

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import save_file

from ditattn.runconfig import ModelConfig, RunConfig, SamplingConfig, ServerConfig
from ditattn.server.app import create_app
from ditattn.server.runner import build_runner
from ditattn.server.scheduler import GenerationJob
from serving import serve_flags, serve_process, wait_video

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the videos API deprecated

KEY = "k-i2v"
LOCAL = "http://localhost"  # a Host name the server answers without an API key


def _png(w=40, h=24, fmt="PNG", seed=0, solid=False) -> bytes:
    buf = io.BytesIO()
    pixels = np.full((h, w, 3), 90, np.uint8) if solid else (np.random.RandomState(seed).rand(h, w, 3) * 255)
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _animated(fmt="PNG") -> bytes:
    """A two-frame animated PNG (APNG) or WebP."""
    buf = io.BytesIO()
    frames = [Image.fromarray(np.full((24, 40, 3), v, np.uint8)) for v in (40, 200)]
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:])
    return buf.getvalue()


def _finished(c, vid) -> dict:
    """Job ``vid`` once it has completed or failed, polled through the in-process ``TestClient`` ``c``."""
    for _ in range(600):
        done = c.get(f"/v1/videos/{vid}").json()
        if done["status"] in ("completed", "failed"):
            return done
        time.sleep(0.05)
    return done


def _lora(path, seed=0):
    """A random diffusers-format LoRA for the tiny DiT's self-attention projections."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(2):
        for proj in ("to_q", "to_v"):
            state[f"transformer.blocks.{i}.attn1.{proj}.lora_A.weight"] = torch.randn(4, 512, generator=g) * 0.1
            state[f"transformer.blocks.{i}.attn1.{proj}.lora_B.weight"] = torch.randn(512, 4, generator=g) * 0.1
    save_file(state, str(path))
    return str(path)


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    return _lora(tmp_path_factory.mktemp("lora") / "style.safetensors")


@pytest.fixture(scope="module")
def app(lora_file):
    cfg = RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan-i2v", lora_path=(lora_file,)),
        sampling=SamplingConfig(num_inference_steps=1, num_frames=5),
    )
    runner = build_runner(cfg)
    with TestClient(
        create_app(runner, ServerConfig(batch_window_s=0.0, max_image_bytes=20_000, max_image_pixels=200 * 200)),
        base_url=LOCAL,
    ) as c:
        yield c


def _error(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "ref,words",
    [
        ({"image_url": "https://example.com/a.png"}, "remote URLs are not fetched"),
        ({"file_id": "file_123"}, "file_id references are not supported"),
        ("data:image/png,abc", "must be base64-encoded"),
        ("!!!notbase64!!!", "not valid base64"),
        (base64.b64encode(b"hello there").decode(), "not a readable image; accepted formats: png, jpeg, webp, bmp"),
        (base64.b64encode(_png(fmt="GIF")).decode(), "format GIF is not supported"),
        (base64.b64encode(_png(8, 8)).decode(), "at least 16 pixels"),
        (base64.b64encode(_png(300, 200, solid=True)).decode(), "at most 40000 pixels"),
        (base64.b64encode(_png(100, 100, fmt="BMP")).decode(), "at most 20000 accepted"),
        (12, "expected a file upload"),
        ("data:text/plain;base64," + base64.b64encode(_png()).decode(), "data URL of type text/plain is not an image"),
        (base64.b64encode(_animated("PNG")).decode(), "an animated image (2 frames) is not accepted"),
        (base64.b64encode(_animated("WEBP")).decode(), "an animated image (2 frames) is not accepted"),
    ],
)
def test_bad_input_reference_is_one_clear_400(app, ref, words):
    err = _error(app.post("/v1/videos", json={"prompt": "x", "input_reference": ref}))
    assert words in err["message"] and err["param"] == "input_reference"


def test_image_model_rules(app):
    err = _error(app.post("/v1/videos", json={"prompt": "x"}))
    assert "image-to-video: input_reference (the first frame) is required" in err["message"]
    err = _error(app.post("/v1/images/generations", json={"prompt": "x"}))
    assert "use POST /v1/videos with input_reference" in err["message"]
    ok = {"prompt": "x", "input_reference": base64.b64encode(_png()).decode()}
    err = _error(app.post("/v1/videos", json={**ok, "lora": {"nope": 1.0}}))
    assert "unknown adapter 'nope'; loaded: style" in err["message"] and err["param"] == "lora"
    err = _error(app.post("/v1/videos", json={**ok, "guidance_scale_2": 2.0}))
    assert "two-expert" in err["message"]
    card = app.get("/v1/models").json()["data"][0]
    assert card["image_input"] == "required"
    assert card["lora_adapters"] == [{"name": "style", "component": "transformer", "scale": 1.0, "fused": False}]


@pytest.mark.parametrize("scale", [True, "0.5", None, [0.5]])
def test_lora_scales_must_be_json_numbers(app, scale):
    """pydantic's lax mode read {"style": true} as 1.0 and {"style": "0.5"} as 0.5 (200); a JSON scale
    must now be a number (400 naming lora), while a form, whose fields are all text, still sends one."""
    ok = {"prompt": "x", "input_reference": base64.b64encode(_png()).decode()}
    err = _error(app.post("/v1/videos", json={**ok, "lora": {"style": scale}}))
    assert err["param"] == "lora" and "the scale of 'style' must be a number" in err["message"], err


def test_lora_scales_from_a_form(app):
    files = {"input_reference": ("first.png", _png(), "image/png")}
    r = app.post("/v1/videos", data={"prompt": "x", "lora[style]": "0.5"}, files=files)
    assert r.status_code == 200, r.text
    assert _finished(app, r.json()["id"])["status"] == "completed"
    err = _error(app.post("/v1/videos", data={"prompt": "x", "lora[style]": "true"}, files=files))
    assert err["param"].startswith("lora") and "expected a number" in err["message"], err


def test_size_follows_the_image(app):
    body = {"prompt": "x", "input_reference": "data:image/png;base64," + base64.b64encode(_png(64, 32)).decode()}
    v = app.post("/v1/videos", json=body).json()
    w, h = map(int, v["size"].split("x"))
    assert w > h and w % 16 == 0 and h % 16 == 0  # the 2:1 image's aspect, the default area (128x128)


def test_batching_signature_keeps_image_and_lora_apart():
    kw = dict(kind="video", prompt="p", width=32, height=32, num_frames=5, num_inference_steps=2, guidance_scale=5.0)
    a, b = GenerationJob(**kw, image=object()), GenerationJob(**kw, image=object())
    assert a.signature() == b.signature() != GenerationJob(**kw).signature()  # different images share a batch
    assert GenerationJob(**kw, lora=(("s", 1.0),)).signature() != GenerationJob(**kw, lora=(("s", 0.5),)).signature()
    assert GenerationJob(**kw, lora=(("s", 1.0),)).signature() != GenerationJob(**kw).signature()


# ------------------------------------------------------------------------------------------------
# end to end


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_file):
    log = tmp_path_factory.mktemp("serve-i2v") / "server.log"
    args = serve_flags(
        model_path="ditattn:tiny-wan-i2v",
        api_key=KEY,
        num_inference_steps=2,
        guidance_scale=3.0,
        num_frames=5,
        lora_path=f"{lora_file}:0.5",
    )
    with serve_process(args, log) as base:
        yield base


def _frames(c, vid):
    import imageio.v3 as iio

    v = wait_video(c, vid)
    assert v.status == "completed", v
    return iio.imread(c.videos.download_content(vid).content, extension=".mp4")


def test_image_to_video_end_to_end(server, tmp_path):
    c = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    path = tmp_path / "first.png"
    path.write_bytes(_png(48, 32, seed=3))
    extra = {"seed": 4, "num_frames": 5, "fps": 8}
    with open(path, "rb") as fh:  # the official client: a multipart upload
        v = c.videos.create(prompt="a boat", input_reference=fh, size="48x32", extra_body=extra)
    by_client = _frames(c, v.id)
    assert by_client.shape == (5, 32, 48, 3)
    # the same job as a plain HTTP multipart request, and as JSON with a base64 data URL
    with open(path, "rb") as fh:
        r = httpx.post(
            server + "/v1/videos",
            headers={"Authorization": f"Bearer {KEY}"},
            data={"prompt": "a boat", "size": "48x32", "seed": "4", "num_frames": "5", "fps": "8"},
            files={"input_reference": ("first.png", fh, "image/png")},
            timeout=60,
        )
    assert r.status_code == 200, r.text
    by_form = _frames(c, r.json()["id"])
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    r = httpx.post(
        server + "/v1/videos",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        json={"prompt": "a boat", "size": "48x32", "input_reference": {"image_url": url}, **extra},
    )
    assert r.status_code == 200, r.text
    by_json = _frames(c, r.json()["id"])
    np.testing.assert_array_equal(by_client, by_form)
    np.testing.assert_array_equal(by_client, by_json)
    # per-request LoRA scales: the load-time scale (0.5) is the default; another scale changes the clip
    same = _frames(
        c,
        c.videos.create(
            prompt="a boat",
            input_reference=path.read_bytes(),
            size="48x32",
            extra_body={**extra, "lora": {"style": 0.5}},
        ).id,
    )
    np.testing.assert_array_equal(same, by_client)
    other = _frames(
        c,
        c.videos.create(
            prompt="a boat",
            input_reference=path.read_bytes(),
            size="48x32",
            extra_body={**extra, "lora": {"style": 4.0}},
        ).id,
    )
    assert not np.array_equal(other, by_client)
    with pytest.raises(openai.BadRequestError) as ei:
        c.videos.create(prompt="a boat", input_reference=b"not an image", size="48x32")
    assert "input_reference: not a readable image" in ei.value.body["message"]


def test_image_to_video_job_survives_a_restart(tmp_path, lora_file):
    """With --output-dir the first frame of an image-to-video job is stored next to the job store,
    a restart runs the re-queued job on it, and the stored frame is removed once the job ends."""
    import json
    import os
    import sqlite3

    from ditattn.server.jobstore import DB_FILE

    out = tmp_path / "serve"
    cfg = RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan-i2v", lora_path=(lora_file,)),
        sampling=SamplingConfig(num_inference_steps=1, num_frames=5),
    )
    runner = build_runner(cfg)
    body = {"prompt": "a boat", "size": "48x32", "seed": 3, "input_reference": base64.b64encode(_png(48, 32)).decode()}
    with TestClient(create_app(runner, ServerConfig(batch_window_s=0.0, output_dir=str(out))), base_url=LOCAL) as c:
        vid = c.post("/v1/videos", json=body).json()["id"]
        done = _finished(c, vid)
        assert done["status"] == "completed", done
        first = c.get(f"/v1/videos/{vid}/content").content
    assert not os.listdir(out / "inputs")  # the stored frame went with the finished job
    # play an unfinished job of the previous run: the same record, queued again, its frame on disk
    db = sqlite3.connect(str(out / DB_FILE))
    (record,) = [json.loads(r) for (r,) in db.execute("SELECT record FROM videos WHERE id = ?", (vid,))]
    name = record["request"]["input_reference_file"]
    Image.open(io.BytesIO(_png(48, 32))).convert("RGB").save(out / name, format="PNG")
    os.remove(out / record["path"])
    record.update(status="queued", path=None, progress=0, completed_at=None)
    db.execute("UPDATE videos SET status = 'queued', record = ? WHERE id = ?", (json.dumps(record), vid))
    db.commit()
    db.close()
    with TestClient(create_app(runner, ServerConfig(batch_window_s=0.0, output_dir=str(out))), base_url=LOCAL) as c:
        done = _finished(c, vid)
        assert done["status"] == "completed", done
        assert c.get(f"/v1/videos/{vid}/content").content == first  # same frame, seed and settings
    assert not (out / name).exists()
    # a re-queued job whose stored frame is gone fails with the reason, and the server keeps serving
    record.update(status="queued", path=None)
    db = sqlite3.connect(str(out / DB_FILE))
    db.execute("UPDATE videos SET status = 'queued', record = ? WHERE id = ?", (json.dumps(record), vid))
    db.commit()
    db.close()
    with TestClient(create_app(runner, ServerConfig(batch_window_s=0.0, output_dir=str(out))), base_url=LOCAL) as c:
        err = c.get(f"/v1/videos/{vid}").json()
        assert err["status"] == "failed" and "first frame" in err["error"]["message"]
