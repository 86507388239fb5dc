"""Fuzz targets (hypothesis) for the user-input surfaces: config strings, config and
strategy files, ``RunConfig`` mappings, the command line, and ``ditattn.attention()`` arguments.

Each target feeds generated input to the real function and accepts exactly two outcomes: a result,
or :class:`~ditattn.errors.AttentionConfigError` (the user-input error every surface promises; the
CLI: exit status 0 or 2 with one ``error:`` line).  Anything else — another exception, a traceback,
a crashed interpreter — fails.  ``tests/cli/test_fuzz.py`` runs them; the attention target runs in a
child process (``python tests/fuzz_targets.py attention N``) so that a kernel that kills the
interpreter (a SIGFPE, as once found) fails the test instead of ending pytest.  The cases are
derandomized (the same every run); ``DITATTN_FUZZ_SCALE=N`` runs N times as many.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ditattn.errors import AttentionConfigError

SCALE = max(1, int(os.environ.get("DITATTN_FUZZ_SCALE", "1")))  # more cases for a deeper local run
SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
COUNTS: dict = {}


def counted(name: str):
    """Count the cases a target ran (COUNTS[name])."""

    def wrap(fn):
        def run(*a, **kw):
            COUNTS[name] = COUNTS.get(name, 0) + 1
            return fn(*a, **kw)

        run.__name__ = fn.__name__
        return run

    return wrap


def user_error_or_result(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an AttentionConfigError is an accepted outcome (returned)."""
    try:
        return fn(*args, **kwargs)
    except AttentionConfigError as exc:
        msg = str(exc)
        assert msg and "Traceback" not in msg and len(msg) < 5000, msg[:300]
        return exc


# ------------------------------------------------------------------------------------------------
# strategies

NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**63, 2**64, 1e308, -1e308, 1e-320, float("nan"), float("inf")]),
    st.just(None).map(lambda _: 10**4999),  # built lazily: hypothesis cannot repr a 5000-digit literal
)
SCALARS = st.one_of(
    NUMBERS,
    st.booleans(),
    st.none(),
    st.text(max_size=40),
    st.sampled_from(["9" * 5000, "1e999", "nan", "-inf", "[" * 50, "{", "true", "0x10", " 4 "]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)
CONFIG_TEXT = st.one_of(
    st.text(alphabet="=,{}[]\"':0123456789abcdeknprstyzE.+-_ ", max_size=60),
    st.text(max_size=40),
    st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(
            ["sparsity", "topk", "impl", "tau", "dense_layers", "chunk", "mask_strategy_file_path", "kv_splits", "x"]
        ),
        st.one_of(st.text(max_size=20), st.sampled_from(["9" * 400, "9" * 5000, "1e400", "[" * 3000, "nan"])),
    ),
    st.sampled_from(["{" * 5000, "a=" + "[" * 5000, '{"a": ' + "9" * 5000 + "}", "{}", "[]", "null", "a=1,,b=2,"]),
)


# ------------------------------------------------------------------------------------------------
# targets (each a hypothesis test, run by tests/cli/test_fuzz.py)


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(
    text=CONFIG_TEXT,
    backend=st.sampled_from(
        [
            "torch_sdpa",
            "video_sparse_attn",
            "sage_attn",
            "sparge_attn",
            "vmoba_attn",
            "sol_attn",
            "sliding_tile_attn",
            "sla_attn",
        ]
    ),
)
@counted("config_strings")
def fuzz_config_strings(text, backend):
    from ditattn.attention.config import (
        parse_attention_backend_config,
        parse_component_overrides,
        validate_backend_config,
    )

    cfg = user_error_or_result(parse_attention_backend_config, text)
    if isinstance(cfg, dict):
        user_error_or_result(validate_backend_config, backend, cfg, strict_unknown=False)
    user_error_or_result(parse_component_overrides, text)


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(
    items=st.dictionaries(
        st.one_of(
            st.sampled_from(sorted(__import__("ditattn.runconfig", fromlist=["RunConfig"]).RunConfig.keys())),
            st.text(max_size=10),
        ),
        VALUES,
        max_size=4,
    )
)
@counted("config_mappings")
def fuzz_config_mappings(items):
    from ditattn.runconfig import RunConfig

    cfg = user_error_or_result(RunConfig.from_mapping, items, source="fuzz")
    if isinstance(cfg, RunConfig):
        user_error_or_result(cfg.attention_settings)
        user_error_or_result(cfg.generate_kwargs)


FILE_BODIES = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass") if False else t.encode("utf-8", "replace")),
    st.builds(
        lambda k, v: f"{k}: {v}\n".encode(),
        st.sampled_from(
            [
                "num-inference-steps",
                "seed",
                "guidance-scale",
                "height",
                "attention-backend-config",
                "port",
                "request-timeout-s",
                "0_0_0",
            ]
        ),
        st.sampled_from(
            [
                "9" * 5000,
                "9" * 400,
                "1e400",
                ".nan",
                "-.inf",
                "[" * 2000 + "]" * 2000,
                "{a: 1}",
                "!!python/object:os.system ls",
                "&a [*a]",
                "[4, 4, 4]",
                "'x'",
            ]
        ),
    ),
    st.sampled_from(
        [
            b"\xff\xfe\x00",
            b"[" * 100000,
            b"{" * 3000,
            b"a: &x [*x, *x]\n",
            b"---\n---\n",
            b"- 1\n- 2\n",
            b'{"0_0_0": [1, 2, 3]}',
            b'{"0_0_0": [' + b"9" * 5000 + b"]}",
        ]
    ),
)


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(body=FILE_BODIES, suffix=st.sampled_from([".yaml", ".yml", ".json"]))
@counted("config_files")
def fuzz_config_files(body, suffix):
    from ditattn.attention.config import load_mapping_file, parse_attention_backend_config
    from ditattn.attention.sparse.sta import load_mask_strategy
    from ditattn.runconfig import RunConfig

    fd, path = tempfile.mkstemp(suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        user_error_or_result(RunConfig.from_file, path)
        user_error_or_result(load_mapping_file, path)
        user_error_or_result(parse_attention_backend_config, path)
        user_error_or_result(load_mask_strategy, path)
    finally:
        os.unlink(path)


CLI_FLAGS = [
    "--num-inference-steps",
    "--guidance-scale",
    "--height",
    "--width",
    "--num-frames",
    "--seed",
    "--fps",
    "--num-gpus",
    "--attention-backend",
    "--attention-backend-config",
    "--component-attention-backends",
    "--skip-softmax-threshold-scale-factor",
    "--skip-softmax-start-step",
    "--output-path",
    "--output-file",
]
SERVE_FLAGS = [
    "--port",
    "--max-queue",
    "--max-batch-size",
    "--request-timeout-s",
    "--drain-timeout-s",
    "--max-output-pixels",
    "--max-body-bytes",
    "--public-url",
    "--max-json-depth",
    "--batch-window-s",
]


@settings(max_examples=100 * SCALE, **SETTINGS)
@given(
    command=st.sampled_from(["generate", "plan", "serve"]),
    pairs=st.lists(
        st.tuples(
            st.sampled_from(CLI_FLAGS + SERVE_FLAGS),
            st.one_of(
                st.text(max_size=20).filter(lambda t: not t.startswith("-")),
                st.sampled_from(
                    [
                        "9" * 5000,
                        "9" * 400,
                        "1e400",
                        "nan",
                        "-1",
                        "0",
                        "1e308",
                        "http://",
                        "ftp://x",
                        "a=" + "[" * 3000,
                        "{" * 3000,
                    ]
                ),
            ),
        ),
        max_size=3,
    ),
)
@counted("cli")
def fuzz_cli(command, pairs):
    """The command line up to the command's ``run`` (replaced: nothing is generated or served)."""
    import importlib

    from ditattn.entrypoints.cli import main

    argv = [command] + (["--prompt", "x"] if command == "generate" else [])
    for flag, value in pairs:
        if (
            command != "serve"
            and flag in SERVE_FLAGS
            or command == "serve"
            and flag in ("--fps", "--output-path", "--output-file")
        ):
            continue
        argv += [flag, value]
    mod = importlib.import_module(f"ditattn.entrypoints.{command}")
    real = mod.run
    mod.run = lambda cfg: (cfg.attention_settings(), 0)[1]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code
    finally:
        mod.run = real
    text = err.getvalue()
    assert rc in (0, 2), (argv, rc, text[-500:])
    if rc == 2:
        lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in text, (argv, text[-500:])


# ------------------------------------------------------------------------------------------------
# attention() arguments (run in a child process)


def _tensor(draw, shape, dtype):
    import torch

    if dtype in (torch.int32, torch.bool):
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape).to(dtype)


@st.composite
def attention_calls(draw):
    """A valid call (shapes, dtype, GQA, backend, arguments) with, in about half the cases, one or
    more arguments replaced by a hostile value (empty or mismatched dims, wrong dtypes, NaN / inf /
    string scales, mis-shaped biases, bad video shapes, unknown backends or config keys)."""
    import numpy as np
    import torch

    hostile = draw(st.booleans())

    def pick(valid, bad):
        return draw(st.sampled_from(bad)) if hostile and draw(st.booleans()) else draw(st.sampled_from(valid))

    b, h = pick([1, 2], [0, 3]), pick([1, 2, 4], [0, 3])
    sq = pick([1, 4, 8, 9], [0])
    skv = pick([sq, sq, 3, 8], [0])
    hkv = pick([h, 1] if h else [1], [0, 3, 2])
    d = pick([8, 16, 64], [0, 1, 33])
    dtype = pick([torch.float32, torch.float32, torch.bfloat16], [torch.float16, torch.float64, torch.int32])
    q = _tensor(draw, (b, sq, h, d), dtype)
    k = _tensor(draw, (b, skv, hkv, d), pick([dtype], [torch.float32, torch.bfloat16]))
    v = k.clone() if not hostile or draw(st.booleans()) else _tensor(draw, (b, skv, hkv, pick([d], [8, 16])), k.dtype)
    kw = {"return_lse": pick([False, True], [1, None, "yes"])}
    if draw(st.booleans()):
        kw["scale"] = pick(
            [None, 0.1, 1.0, np.float32(0.2), 3],
            [float("nan"), float("inf"), -1.0, 0.0, 1e-30, 1e30, "x", True, torch.tensor(0.1)],
        )
    if draw(st.booleans()):
        kw["causal"] = pick([True, False], [1, "yes", None])
    if draw(st.booleans()):
        if hostile and draw(st.booleans()):
            kw["attn_bias"] = draw(
                st.sampled_from(
                    [
                        5,
                        "bias",
                        torch.zeros(3, 3),
                        torch.zeros(1, 1, 1, 1, skv or 1),
                        torch.zeros((b, h, sq, skv), dtype=torch.int64),
                    ]
                )
            )
        else:
            shape = draw(st.sampled_from([(b, h, sq, skv), (sq, skv), (1, 1, 1, skv), (skv,), (b, 1, sq, skv), ()]))
            kw["attn_bias"] = _tensor(draw, shape, draw(st.sampled_from([torch.float32, torch.bool, torch.bfloat16])))
    if draw(st.booleans()):
        kw["backend"] = pick(
            [
                None,
                "torch_sdpa",
                "fa",
                "sage_attn",
                "video_sparse_attn",
                "sliding_tile_attn",
                "sparge_attn",
                "vmoba_attn",
                "sla_attn",
                "sol_attn",
                "sparse_video_gen_2_attn",
            ],
            ["nope", 5, "torch_cudnn_sdpa", "aiter", "fp8_fa_sm120"],
        )
    if draw(st.booleans()):
        kw["config"] = pick(
            [None, "", "sparsity=0.5", "impl=reference", "topk=0.5"],
            ["{", {"x": 1}, "topk=2", {"sparsity": float("nan")}, "a=" + "[" * 3000],
        )
    if draw(st.booleans()):
        grid = draw(st.sampled_from([(1, 1, sq), (1, 2, sq // 2), (1, 3, 3), (2, 2, 2)]))
        kw["video_shape"] = pick(
            [grid if all(x > 0 for x in grid) else (1, 1, max(sq, 1))], [(0, 1, 1), "abc", (1.5, 1, 1), (1, 2), None]
        )
    if draw(st.booleans()):
        kw["text_len"] = pick([0], [-1, 2, 1.5, True, 10**20])
    for name in ("step", "layer_idx"):
        if draw(st.booleans()):
            kw[name] = pick([None, 0, 3], [-1, "0", 2**70])
    return q, k, v, kw


def fuzz_attention(n: int) -> None:
    import ditattn

    @settings(max_examples=n, **SETTINGS)
    @given(call=attention_calls())
    @counted("attention")
    def one(call):
        q, k, v, kw = call
        out = user_error_or_result(ditattn.attention, q, k, v, **kw)
        if isinstance(out, AttentionConfigError):
            return
        o = out[0] if isinstance(out, tuple) else out
        assert o.shape == q.shape, (o.shape, q.shape)
        if isinstance(out, tuple):
            assert out[1].shape == (q.shape[0], q.shape[2], q.shape[1])

    one()


if __name__ == "__main__":  # python tests/fuzz_targets.py attention N  -> prints {"attention": cases}
    if sys.argv[1:2] != ["attention"]:
        sys.exit("usage: fuzz_targets.py attention N")
    fuzz_attention(int(sys.argv[2]))
    print(json.dumps(COUNTS))
    assert math.isfinite(COUNTS.get("attention", 0))
