"""The step cache under sequence parallelism (2 gloo ranks, Ulysses 2 and ring 2): every rank takes the
same decisions as the single-process run (the L1 sums are all-reduced; padding rows ignored) and the
cached output equals the single-process cached output."""

import torch

from ditattn.attention.context import AttentionSettings
from ditattn.distributed import destroy_sequence_parallel, init_sequence_parallel

# 9 frames at 48x48 on the embedded model: 27 tokens (2 ranks: 14 each, one padding row)
GEN = dict(
    height=48,
    width=48,
    num_frames=9,
    num_inference_steps=8,
    seed=3,
    guidance_scale=3.0,
    output_type="latent",
    progress=False,
)
CACHES = [("teacache", "threshold=0.4,start_step=1"), ("first_block_cache", "threshold=0.3,start_step=1")]


def _pipe(settings):
    from ditattn.pipelines.wan import WanPipelineNative

    return WanPipelineNative.from_pretrained("ditattn:shapes", settings, device="cpu", dtype="float32")


def _runs(pipe):
    out = {}
    for name, cfg in CACHES:
        res = pipe.generate("a red circle moving right", cache_backend=name, cache_backend_config=cfg, **GEN)
        out[name] = (res.frames, res.cache["trace"])
    return out


def _worker(groups, configs):
    out = {}
    for u, r in configs:
        destroy_sequence_parallel()
        init_sequence_parallel(u, r)
        out[f"U{u}R{r}"] = _runs(_pipe(AttentionSettings(ulysses_degree=u, ring_degree=r)))
    return out


def test_two_ranks_decide_and_compute_like_one_process():
    from ditattn.distributed.launch import spawn_ranks

    single = _runs(_pipe(AttentionSettings()))
    for name, (_, trace) in single.items():
        assert "R" in trace and trace.count("C") > 2, (name, trace)  # the decisions are not trivial
    results = spawn_ranks(_worker, 2, args=([(2, 1), (1, 2)],), ulysses_degree=2, timeout_s=300)
    for rank_res in results:
        for layout in ("U2R1", "U1R2"):
            for name, (frames, trace) in rank_res[layout].items():
                want_frames, want_trace = single[name]
                assert trace == want_trace, (layout, name, trace, want_trace)
                err = ((frames - want_frames).norm() / want_frames.norm()).item()
                assert err < 1e-4, (layout, name, err)
    assert torch.equal(results[0]["U2R1"]["teacache"][0], results[1]["U2R1"]["teacache"][0])
