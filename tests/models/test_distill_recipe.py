"""The step-distilled recipe: step-distill LoRAs in their published key layouts load onto both experts
of ``ditattn:tiny-wan2.2`` (synthetic tensors with the real key names, shapes scaled to the tiny model),
and the recipe (lcm, explicit timesteps, shift 5, guidance 1) runs end to end through ``ditattn generate``."""

import pytest
import torch
from safetensors.torch import save_file

from ditattn.cli import main
from ditattn.errors import AttentionConfigError

DIM, FFN, TEXT, FREQ, OUT, RANK, LAYERS = 512, 512, 64, 64, 64, 4, 2
PATCH = (DIM, 16, 1, 2, 2)


def linear_pairs():
    """Original-layout linear layers of a Wan DiT -> (native module name, in, out)."""
    out = {}
    for i in range(LAYERS):
        for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"]):
            out[f"blocks.{i}.self_attn.{o}"] = (f"blocks.{i}.attn1.{c}", DIM, DIM)
            out[f"blocks.{i}.cross_attn.{o}"] = (f"blocks.{i}.attn2.{c}", DIM, DIM)
        out[f"blocks.{i}.ffn.0"] = (f"blocks.{i}.ffn.net.0.proj", DIM, FFN)
        out[f"blocks.{i}.ffn.2"] = (f"blocks.{i}.ffn.net.2", FFN, DIM)
    out["time_projection.1"] = ("condition_embedder.time_proj", DIM, 6 * DIM)
    out["text_embedding.0"] = ("condition_embedder.text_embedder.linear_1", TEXT, DIM)
    out["text_embedding.2"] = ("condition_embedder.text_embedder.linear_2", DIM, DIM)
    out["time_embedding.0"] = ("condition_embedder.time_embedder.linear_1", FREQ, DIM)
    out["time_embedding.2"] = ("condition_embedder.time_embedder.linear_2", DIM, DIM)
    return out


def full_deltas():
    """Original-layout parameters that distill LoRAs patch with full ``.diff`` tensors -> (native name, shape)."""
    out = {
        "head.head": ("proj_out.weight", (OUT, DIM)),
        "head.modulation": ("scale_shift_table", (1, 2, DIM)),
        "patch_embedding": ("patch_embedding.weight", PATCH),
    }
    for i in range(LAYERS):
        out[f"blocks.{i}.norm3"] = (f"blocks.{i}.norm2.weight", (DIM,))
        out[f"blocks.{i}.modulation"] = (f"blocks.{i}.scale_shift_table", (1, 6, DIM))
        for a, n in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            for q in ("norm_q", "norm_k"):
                out[f"blocks.{i}.{a}.{q}"] = (f"blocks.{i}.{n}.{q}.weight", (DIM,))
    return out


def bias_deltas():
    """``.diff_b`` tensors -> native bias names (every linear, the cross-attention norm, the head, the patch)."""
    out = {k: (v[0] + ".bias", v[2]) for k, v in linear_pairs().items()}
    out["head.head"] = ("proj_out.bias", OUT)
    out["patch_embedding"] = ("patch_embedding.bias", DIM)
    for i in range(LAYERS):
        out[f"blocks.{i}.norm3"] = (f"blocks.{i}.norm2.bias", DIM)
    return out


def distill_lora(path, seed):
    """A LightX2V / Kijai-style distill LoRA file: lora_down / lora_up / alpha, .diff and .diff_b tensors under
    ``diffusion_model.``; returns the expected change of every native parameter it touches (at scale 1)."""
    g = torch.Generator().manual_seed(seed)
    tensors, expected = {}, {}
    for key, (native, fan_in, fan_out) in linear_pairs().items():
        down, up = torch.randn(RANK, fan_in, generator=g) * 0.05, torch.randn(fan_out, RANK, generator=g) * 0.05
        alpha = float(RANK * 2)
        tensors[f"diffusion_model.{key}.lora_down.weight"] = down
        tensors[f"diffusion_model.{key}.lora_up.weight"] = up
        tensors[f"diffusion_model.{key}.alpha"] = torch.tensor(alpha)
        expected[native + ".weight"] = (alpha / RANK) * up.double() @ down.double()
    for key, (native, shape) in full_deltas().items():
        tensors[f"diffusion_model.{key}.diff"] = d = torch.randn(shape, generator=g) * 0.01
        expected[native] = d.double()
    for key, (native, n) in bias_deltas().items():
        tensors[f"diffusion_model.{key}.diff_b"] = d = torch.randn(n, generator=g) * 0.01
        expected[native] = d.double()
    save_file(tensors, str(path))
    return expected


def peft_lora(path, seed):
    """A diffusers / PEFT-layout LoRA (``transformer.blocks.0.attn1.to_q.lora_A.weight``)."""
    g = torch.Generator().manual_seed(seed)
    tensors, expected = {}, {}
    for i in range(LAYERS):
        for m in ("attn1.to_q", "attn2.to_v", "ffn.net.2"):
            a, b = torch.randn(RANK, DIM, generator=g) * 0.05, torch.randn(DIM, RANK, generator=g) * 0.05
            tensors[f"transformer.blocks.{i}.{m}.lora_A.weight"] = a
            tensors[f"transformer.blocks.{i}.{m}.lora_B.weight"] = b
            expected[f"blocks.{i}.{m}.weight"] = b.double() @ a.double()
    save_file(tensors, str(path))
    return expected


@pytest.fixture(scope="module")
def base():
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan2.2", device="cpu", dtype="float32")
    return {
        c: {k: v.detach().clone() for k, v in pipe.components[c].state_dict().items()}
        for c in ("transformer", "transformer_2")
    }


def check_changes(model, before, expected, scale):
    after = model.state_dict()
    changed = 0
    for name, old in before.items():
        diff = after[name].double() - old.double()
        if name in expected:
            torch.testing.assert_close(diff, scale * expected[name], rtol=1e-4, atol=1e-6, msg=name)
            changed += 1
        else:
            assert diff.abs().max() == 0, f"{name} changed but the LoRA does not touch it"
    assert changed == len(expected)


@pytest.mark.parametrize("layout", ["distill", "peft"])
def test_layouts_load_onto_both_experts(tmp_path, base, layout):
    from ditattn.pipelines.wan import WanPipelineNative

    make = distill_lora if layout == "distill" else peft_lora
    hi, lo = tmp_path / "high_noise.safetensors", tmp_path / "low_noise.safetensors"
    exp_hi, exp_lo = make(hi, 1), make(lo, 2)
    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan2.2",
        device="cpu",
        dtype="float32",
        lora_fuse=True,
        lora=[f"transformer={hi}:0.5", f"transformer_2={lo}"],
    )
    assert [(a.component, a.layers) for a in pipe.adapters] == [
        ("transformer", len(exp_hi)),
        ("transformer_2", len(exp_lo)),
    ]
    check_changes(pipe.components["transformer"], base["transformer"], exp_hi, 0.5)
    check_changes(pipe.components["transformer_2"], base["transformer_2"], exp_lo, 1.0)


def test_unfused_distill_lora_keeps_deltas_and_request_scales(tmp_path, base):
    """Unfused: the full deltas are in the weights at the load scale; the low-rank part follows the scale."""
    from ditattn.models.lora import LoRALinear, lora_scales
    from ditattn.pipelines.wan import WanPipelineNative

    f = tmp_path / "distill.safetensors"
    expected = distill_lora(f, 3)
    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan2.2", device="cpu", dtype="float32", lora=[f"transformer_2={f}"], lora_fuse=False
    )
    model = pipe.components["transformer_2"]
    norm = model.get_parameter("blocks.1.norm2.weight").double() - base["transformer_2"]["blocks.1.norm2.weight"]
    torch.testing.assert_close(norm, expected["blocks.1.norm2.weight"], rtol=1e-5, atol=1e-7)
    layer = model.get_submodule("blocks.0.attn1.to_q")
    assert isinstance(layer, LoRALinear)
    x = torch.randn(3, DIM, dtype=torch.float32)
    w = base["transformer_2"]["blocks.0.attn1.to_q.weight"].double()
    b = base["transformer_2"]["blocks.0.attn1.to_q.bias"].double() + expected["blocks.0.attn1.to_q.bias"]
    for s in (0.0, 1.0):
        with lora_scales({"distill": s}):
            got = layer(x).double()
        ref = x.double() @ (w + s * expected["blocks.0.attn1.to_q.weight"]).T + b
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_delta_for_another_model_is_refused(tmp_path):
    from ditattn.pipelines.wan import WanPipelineNative

    f = tmp_path / "wide.safetensors"
    save_file(
        {
            "diffusion_model.blocks.0.norm3.diff": torch.zeros(1024),
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(RANK, DIM),
            "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(DIM, RANK),
        },
        str(f),
    )
    with pytest.raises(
        AttentionConfigError,
        match=r"blocks\.0\.norm2\.weight is \(512,\) but the LoRA's delta is "
        r"\(1024,\)",
    ):
        WanPipelineNative.from_pretrained(
            "ditattn:tiny-wan2.2", device="cpu", dtype="float32", lora=[str(f)], lora_fuse=True
        )


def test_recipe_end_to_end(tmp_path, capsys):
    """The documented 4-step recipe through `ditattn generate`: a distill LoRA per expert, lcm at shift 5 on the
    distilled timesteps, guidance 1 (one DiT forward per step)."""
    hi, lo = tmp_path / "high.safetensors", tmp_path / "low.safetensors"
    distill_lora(hi, 4)
    distill_lora(lo, 5)
    out = tmp_path / "clip.mp4"
    capsys.readouterr()
    rc = main(
        [
            "generate",
            "--model-path",
            "ditattn:tiny-wan2.2",
            "--prompt",
            "a fox",
            "--height",
            "32",
            "--width",
            "48",
            "--num-frames",
            "5",
            "--lora-path",
            f"transformer={hi}",
            "--lora-path",
            f"transformer_2={lo}",
            "--scheduler",
            "lcm",
            "--flow-shift",
            "5",
            "--timesteps",
            "1000,750,500,250",
            "--guidance-scale",
            "1",
            "--output-path",
            str(out),
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and lines[0] == f"saved: {out}" and out.stat().st_size > 0
    assert "4 steps, lcm shift 5, 4 DiT forwards, CFG off (load" in lines[-1]


def test_server_request_fields(tmp_path):
    """The sampler fields of a request: validated (400 naming the field) and run (an image and a video job)."""
    import base64
    import time

    from fastapi.testclient import TestClient

    from ditattn.runconfig import ModelConfig, RunConfig, SamplingConfig, ServerConfig
    from ditattn.server.app import create_app
    from ditattn.server.runner import build_runner

    cfg = RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan"),
        sampling=SamplingConfig(num_inference_steps=2, num_frames=1, height=32, width=48, scheduler="flow_euler"),
    )
    runner = build_runner(cfg)
    with TestClient(
        create_app(runner, ServerConfig(batch_window_s=0.0, max_steps=8, max_output_pixels=10**6)),
        base_url="http://localhost",
    ) as c:
        for body, field, words in [
            ({"timesteps": [500, 750]}, "timesteps", "not descending"),
            ({"timesteps": "1500,10"}, "timesteps", "above this checkpoint's num_train_timesteps (1000)"),
            ({"timesteps": list(range(900, 0, -100))}, "timesteps", "at most 8 (the server's --max-steps)"),
            ({"timesteps": [1000, 500], "scheduler": "dpmpp"}, "timesteps", "works with scheduler flow_euler"),
            ({"scheduler": "ddim"}, "scheduler", "expected one of flow_euler, unipc, dpmpp, lcm"),
            ({"flow_shift": -1}, "flow_shift", "expected a positive number"),
            ({"cfg_interval": "0.5:0.2"}, "cfg_interval", "START must be below END"),
        ]:
            r = c.post("/v1/images/generations", json={"prompt": "x", "size": "48x32", **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == field and words in err["message"], (body, err)
        r = c.post(
            "/v1/images/generations",
            json={
                "prompt": "x",
                "size": "48x32",
                "scheduler": "lcm",
                "flow_shift": 5,
                "timesteps": [1000, 750, 500, 250],
                "guidance_scale": 1,
                "response_format": "b64_json",
            },
        )
        assert r.status_code == 200, r.text
        assert base64.b64decode(r.json()["data"][0]["b64_json"])[:4] == b"\x89PNG"
        # the fields reach the pipeline: same seed, another sampler, another image; the same fields, the same image
        images = []
        for body in ({"scheduler": "lcm", "timesteps": "1000,500"}, {}, {"scheduler": "lcm", "timesteps": "1000,500"}):
            r = c.post(
                "/v1/images/generations",
                json={"prompt": "x", "size": "48x32", "seed": 4, "response_format": "b64_json", **body},
            )
            images.append(r.json()["data"][0]["b64_json"])
        assert images[0] != images[1] and images[0] == images[2]
        # multipart form values are text: "1000,500" and "0:0.5"
        v = c.post(
            "/v1/videos",
            data={
                "prompt": "x",
                "size": "48x32",
                "seconds": "1",
                "timesteps": "1000,500",
                "cfg_interval": "0:0.5",
                "scheduler": "unipc",
            },
        )
        assert v.status_code == 200, v.text
        for _ in range(600):
            done = c.get(f"/v1/videos/{v.json()['id']}").json()
            if done["status"] in ("completed", "failed"):
                break
            time.sleep(0.05)
        assert done["status"] == "completed", done
