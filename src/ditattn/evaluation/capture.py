"""Forward hooks on a DiT's self-attention layers: outputs, in-context errors, kept fractions and Q/K/V.

:class:`AttentionRecorder` hooks every self-attention :class:`~ditattn.attention.layer.LocalAttention`
(including the sequence-parallel subclasses) inside the given modules.  While it is active:

* at the chosen denoising steps it keeps each layer's output on the CPU, restricted to a fixed
  sample of sequence rows (``rows``; the same rows for every run of the same sequence length),
  so that two runs can be compared layer by layer afterwards (:meth:`compare_to`);
* at the same steps, when ``reference`` names a backend per layer key, it also runs that backend
  on the layer's own q/k/v and records the relative L2 error and cosine of the layer's output
  against it (the *in-context* error: the attention approximation alone, without the drift that
  accumulates when two runs' trajectories differ);
* at every step it reads the sparse engine's statistics of the call (kept fraction of blocks,
  dense phases), so a run reports the mean kept fraction over all its sparse-backend calls;
* ``hook_s`` accumulates the wall time of the hook work (synchronised on CUDA), so callers can
  report the DiT's time without it.

:func:`capture_qkv` records q/k/v of chosen layers and steps instead and writes them in the
activation file format that ``bench/fidelity.py --activations`` reads (:data:`QKV_FORMAT`).
"""

from __future__ import annotations

import json
import time
from typing import Iterable, Optional, Sequence

import torch

from ditattn.evaluation.metrics import tensor_errors

Tensor = torch.Tensor

#: format tag of activation files written by :func:`capture_qkv`
QKV_FORMAT = "ditattn-qkv-v1"


class ActivationFileError(ValueError):
    """An activation file that cannot be read (missing, another format, incomplete)."""


def self_attention_layers(modules: Iterable[torch.nn.Module]) -> list:
    """The self-attention ``LocalAttention`` layers inside ``modules``, in module order."""
    from ditattn.attention.layer import LocalAttention

    out = []
    for mod in modules:
        for sub in mod.modules():
            if isinstance(sub, LocalAttention) and sub.role == "self":
                out.append(sub)
    return out


def resolve_steps(steps: Sequence[int], num_steps: int) -> set[int]:
    """Step indices with negatives counted from the end (``-1`` = the last step); out of range
    entries raise :class:`AttentionConfigError`."""
    from ditattn.errors import AttentionConfigError

    out = set()
    for s in steps:
        r = s + num_steps if s < 0 else s
        if not 0 <= r < num_steps:
            raise AttentionConfigError(
                f"capture step {s} is outside the run's {num_steps} steps (0..{num_steps - 1}, or "
                f"-1..-{num_steps} from the end)"
            )
        out.add(r)
    return out


def sample_rows(seq_len: int, n: int) -> Optional[Tensor]:
    """A fixed sorted sample of ``n`` of ``seq_len`` rows (None = all rows, when ``n`` is 0 or
    ``n >= seq_len``); the same for every call with the same arguments."""
    if n <= 0 or n >= seq_len:
        return None
    g = torch.Generator().manual_seed(seq_len)
    return torch.randperm(seq_len, generator=g)[:n].sort().values


def _sync(t: Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class AttentionRecorder:
    """Hooks on the self-attention layers of ``modules`` (see the module docstring).

    steps: capture steps (already resolved, non-negative); rows: sequence rows kept per captured
    output (0 = all); reference: ``{layer_key: (backend, config)}`` for in-context errors (None =
    none); keep_outputs: keep the sampled outputs for :meth:`compare_to`.

    After the run: ``outputs[(layer_key, step)]`` (CPU tensors ``[B, rows, H, D]``),
    ``in_context[(layer_key, step)] = (rel_err, cosine)``, ``kept`` (kept fractions of the sparse
    calls), ``dense_calls`` (dense phases) / ``fallback_calls`` (run dense by a backend's size rule or
    error budget) / ``sparse_calls``, ``hook_s``.  Use as a context manager.
    """

    def __init__(
        self,
        modules: Iterable[torch.nn.Module],
        *,
        steps: Iterable[int],
        rows: int = 4096,
        reference: Optional[dict] = None,
        keep_outputs: bool = True,
    ):
        self.layers = self_attention_layers(modules)
        self.steps = set(steps)
        self.rows = int(rows)
        self.reference = reference
        self.keep_outputs = keep_outputs
        self.outputs: dict[tuple[str, int], Tensor] = {}
        self.in_context: dict[tuple[str, int], tuple[float, float]] = {}
        self.kept: list[float] = []
        self.dense_calls = 0
        self.fallback_calls = 0
        self.sparse_calls = 0
        self.hook_s = 0.0
        self._handles: list = []

    def __enter__(self) -> "AttentionRecorder":
        from ditattn.attention.sparse import clear_stats

        clear_stats()  # the statistics read below are this run's
        for layer in self.layers:
            self._handles.append(layer.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, module, args, kwargs, output) -> None:
        from ditattn.attention.context import current_forward
        from ditattn.attention.sparse import last_stats

        fwd = current_forward()
        st = last_stats.get(module.layer_key)
        if st is not None and st.get("step") == fwd.step:
            if st.get("fallback"):  # the size rule or the error budget ran the call dense
                self.fallback_calls += 1
            elif st.get("dense"):
                self.dense_calls += 1
            else:
                self.sparse_calls += 1
            self.kept.append(float(st["kept_fraction"]))
        if fwd.step not in self.steps:
            return
        out = output[0] if isinstance(output, tuple) else output
        _sync(out)
        t0 = time.perf_counter()
        rows = sample_rows(out.shape[1], self.rows)
        sel = out if rows is None else out[:, rows.to(out.device)]
        key = (module.layer_key, int(fwd.step))
        if self.keep_outputs:
            self.outputs[key] = sel.detach().to("cpu", copy=True)
        if self.reference is not None and module.layer_key in self.reference and len(args) >= 3:
            ref = self._reference_output(module, args[0], args[1], args[2], rows, fwd)
            self.in_context[key] = tensor_errors(sel, ref)
        _sync(out)
        self.hook_s += time.perf_counter() - t0

    def _reference_output(self, module, q, k, v, rows, fwd) -> Tensor:
        from ditattn.attention.functional import attention
        from ditattn.attention.specs import SPECS

        backend, config = self.reference[module.layer_key]
        dense = SPECS[backend].kind in ("dense", "quantized")
        if dense and rows is not None:  # only the sampled query rows
            return attention(
                q[:, rows.to(q.device)], k, v, backend=backend, config=config, causal=module.causal, scale=module.scale
            )
        out = attention(
            q,
            k,
            v,
            backend=backend,
            config=config,
            causal=module.causal,
            scale=module.scale,
            video_shape=fwd.video_shape,
            text_len=fwd.text_len,
            step=fwd.step,
            layer_idx=module.layer_idx,
        )
        return out if rows is None else out[:, rows.to(out.device)]

    def compare_to(self, ref: "AttentionRecorder") -> list[dict]:
        """Per captured (layer, step) present in both: ``{"layer", "step", "rel_err", "cosine",
        "in_context_rel_err", "in_context_cosine"}`` of this run's outputs against ``ref``'s."""
        rows = []
        for key in sorted(self.outputs, key=lambda k: (k[1], k[0])):
            if key not in ref.outputs:
                continue
            rel, cos = tensor_errors(self.outputs[key], ref.outputs[key])
            ic = self.in_context.get(key)
            rows.append(
                {
                    "layer": key[0],
                    "step": key[1],
                    "rel_err": rel,
                    "cosine": cos,
                    "in_context_rel_err": ic[0] if ic else None,
                    "in_context_cosine": ic[1] if ic else None,
                }
            )
        return rows

    def kept_fraction(self) -> Optional[float]:
        """Mean kept block fraction over this run's sparse-engine calls (dense phases count as 1);
        None when no call went through the sparse engine."""
        return sum(self.kept) / len(self.kept) if self.kept else None


# ------------------------------------------------------------------------------------------------
# Q/K/V capture for the fidelity benchmark


def capture_qkv(
    pipe,
    prompt: str,
    path: str,
    *,
    steps: Sequence[int] = (-1,),
    layers: Optional[Sequence[int]] = None,
    seed: int = 0,
    batch_index: int = 0,
    **generate_kw,
) -> list[dict]:
    """Generate once with ``pipe`` (a :class:`~ditattn.pipelines.wan.WanPipelineNative`) and write
    the q/k/v that the DiT's self-attention layers saw at ``steps`` to a safetensors file.

    Activation file format (``QKV_FORMAT`` = ``ditattn-qkv-v1``): tensors ``"<name>.q"``,
    ``"<name>.k"``, ``"<name>.v"`` of shape ``[1, S, heads, head_dim]`` (kv heads for k/v) in the
    run's dtype, one triple per entry; the file's metadata holds ``format`` and ``entries``, a JSON
    list of ``{"name", "layer", "layer_idx", "step", "video_shape": [T, H, W], "text_len", "scale",
    "prompt", "seed", "model"}``.  ``name`` is ``"<layer key>@step<step>"``.  ``layers``: DiT block
    indices to keep (None = all); ``batch_index``: which batch row (0 = the conditional half under
    classifier-free guidance).  Returns the entries.
    """
    from safetensors.torch import save_file

    from ditattn.attention.context import current_forward

    num_steps = generate_kw.get("num_inference_steps") or pipe.defaults["num_inference_steps"]
    want = resolve_steps(steps, num_steps)
    keep_layers = None if layers is None else set(int(x) for x in layers)
    attn_layers = self_attention_layers(pipe.dit_modules)
    if keep_layers is not None:  # an index the model does not have would be dropped silently
        from ditattn.errors import AttentionConfigError

        have = sorted({m.layer_idx for m in attn_layers})
        bad = sorted(keep_layers - set(have))
        if bad:
            raise AttentionConfigError(
                f"layers {', '.join(map(str, bad))}: this model's DiT has no such block; accepted: block indices "
                f"{have[0]} to {have[-1]} ({len(have)} blocks)"
            )
    tensors: dict[str, Tensor] = {}
    entries: list[dict] = []

    def hook(module, args, kwargs, output):
        fwd = current_forward()
        if fwd.step not in want or (keep_layers is not None and module.layer_idx not in keep_layers):
            return
        name = f"{module.layer_key}@step{fwd.step}"
        for tag, t in zip("qkv", args[:3]):
            tensors[f"{name}.{tag}"] = t[batch_index : batch_index + 1].detach().to("cpu").contiguous()
        entries.append(
            {
                "name": name,
                "layer": module.layer_key,
                "layer_idx": module.layer_idx,
                "step": int(fwd.step),
                "video_shape": list(fwd.video_shape),
                "text_len": int(fwd.text_len),
                "scale": module.scale,
                "prompt": prompt,
                "seed": int(seed),
                "model": pipe.model_index.name,
            }
        )

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attn_layers]
    try:
        pipe.generate(prompt, seed=seed, output_type="latent", **generate_kw)
    finally:
        for h in handles:
            h.remove()
    if not entries:
        raise ValueError(f"no self-attention call matched steps {list(steps)} and layers {layers}")
    save_file(tensors, path, metadata={"format": QKV_FORMAT, "entries": json.dumps(entries)})
    return entries


def load_qkv(path: str) -> list[tuple[dict, Tensor, Tensor, Tensor]]:
    """Read an activation file (:func:`capture_qkv`): ``[(entry, q, k, v), ...]`` with tensors
    ``[1, S, heads, D]``.  Raises :class:`ActivationFileError` naming what is wrong with a file of another format."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("format") != QKV_FORMAT:
                raise ActivationFileError(
                    f"{path}: not a ditattn activation file (metadata format {meta.get('format')!r}, "
                    f"expected {QKV_FORMAT!r}; write one with bench/capture_qkv.py)"
                )
            entries = json.loads(meta["entries"])
            out = []
            for e in entries:
                q, k, v = (fh.get_tensor(f"{e['name']}.{t}") for t in "qkv")
                out.append((e, q, k, v))
    except ActivationFileError:
        raise
    except Exception as exc:  # safetensors' own errors, missing keys, bad JSON
        raise ActivationFileError(f"{path}: cannot read the activation file ({type(exc).__name__}: {exc})") from None
    return out
