"""The typed run configuration: what a ``ditattn`` command runs, built once and passed down.

:class:`RunConfig` holds one of each section:

* :class:`ModelConfig` — what to load, on which device and dtype, compiled or not;
* :class:`SamplingConfig` — prompt and sampling (size, frames, steps, guidance, seed);
* :class:`AttentionOptions` — the user's attention choices (become
  :class:`~ditattn.attention.context.AttentionSettings` through :meth:`RunConfig.attention_settings`);
* :class:`CacheOptions` — the step cache (``--cache-backend``, ``--cache-backend-config``);
* :class:`ParallelConfig` — sequence, CFG and VAE parallelism (``num_gpus = cfg × ulysses_degree × ring_degree``);
* :class:`OutputConfig` — where ``generate`` writes;
* :class:`ServerConfig` — ``serve``'s address, batching and request limits;
* :class:`SimulationConfig` — ``plan`` / ``backends``: resolve on a simulated platform;
* :class:`CompareOptions` — ``compare``: prompts, seeds, variants and what is captured
  (the last three, each read by one command, in :mod:`ditattn.runconfig.commands`);

plus ``verbose`` and ``json``.  Every field's name is the long flag without its dashes
(``--num-inference-steps`` → ``num_inference_steps``), so the same object is built from the CLI
(:mod:`ditattn.entrypoints.cli`), from a YAML/JSON file (:meth:`RunConfig.from_file`, keys
``num-inference-steps`` or ``num_inference_steps``), from a mapping (:meth:`RunConfig.from_mapping`)
or in Python::

    cfg = RunConfig(sampling=SamplingConfig(prompt="a fox", num_frames=1),
                    attention=AttentionOptions(attention_backend="torch_sdpa"))
    pipe = WanPipelineNative.from_config(cfg)
    res = pipe.generate(**cfg.generate_kwargs())

Each field is validated on construction by its check (:mod:`ditattn.runconfig.checks`, attached
through :mod:`ditattn.runconfig.fields`; :class:`AttentionConfigError` naming the key and what is
accepted); rules across fields live in :meth:`ParallelConfig.degrees`,
:meth:`AttentionOptions.skip_softmax` and the commands.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping, Optional, Union

from ditattn.errors import AttentionConfigError, short_repr, short_text
from ditattn.models.builtin import BUILTIN_MODELS, DEFAULT_MODEL
from ditattn.runconfig.checks import (
    boolean,
    float_between,
    fraction_interval,
    int_between,
    lora_specs,
    nonempty_text,
    one_of,
    optional,
    plain_name,
    positive_int,
    text,
    text_or_mapping,
    timestep_list,
)
from ditattn.runconfig.commands import (
    BackendsOptions,
    CalibrateOptions,
    CompareOptions,
    ServerConfig,
    SimulationConfig,
)
from ditattn.runconfig.fields import MAX_FPS, MAX_FRAMES, MAX_GPUS, MAX_GUIDANCE, MAX_SEED, MAX_SIDE, MAX_STEPS
from ditattn.runconfig.fields import Section as _Section  # the short names the sections below use
from ditattn.runconfig.fields import setting as _field
from ditattn.runconfig.sampling import CFG_BATCHING, SCHEDULERS, CacheOptions, SamplingConfig

# ------------------------------------------------------------------------------------------------
# sections

DTYPES = ("float32", "bfloat16", "float16")
#: where components live between uses (ditattn.pipelines.offload)
OFFLOAD_MODES = ("none", "text_encoder", "model", "group")
DIT_QUANTIZATION = ("none", "fp8", "int8")  # ditattn.models.quantization.MODES


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    """What to load and how to run it."""

    model_path: Optional[str] = _field(
        None,
        optional(nonempty_text),
        "local diffusers-format Wan checkpoint directory, a Hugging Face repo id "
        "(org/name, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers: the local cache first, "
        "else a download; HF_HUB_OFFLINE=1 honoured), or a built-in model built "
        "locally without downloading: "
        + ", ".join(n + (" (the default)" if n == DEFAULT_MODEL else "") for n in BUILTIN_MODELS),
        metavar="PATH_OR_ID",
    )
    revision: Optional[str] = _field(
        None, optional(text), "branch, tag or commit of a Hugging Face repo id (default main)", metavar="REV"
    )
    local_files_only: bool = _field(
        False, boolean, "resolve a Hugging Face repo id from the local cache only (never download)"
    )
    model_variant: Optional[str] = _field(
        None, optional(text), "weights variant, for checkpoints that have several", metavar="NAME"
    )
    device: Optional[str] = _field(
        None, optional(plain_name), "cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)", metavar="DEVICE"
    )
    dtype: Optional[str] = _field(
        None, optional(one_of(*DTYPES)), "compute dtype (default float32 on cpu, bfloat16 on GPUs)"
    )
    backend: str = _field(
        "native", one_of("native", "diffusers"), "native ditattn pipeline, or the stock diffusers pipeline"
    )
    enable_torch_compile: bool = _field(
        False,
        boolean,
        "torch.compile each DiT block (attention stays eager, so backend selection "
        "still applies); per-request overrides and skip softmax are then refused",
    )
    enable_cuda_graph: bool = _field(
        False,
        boolean,
        "CUDA only: compile the DiT blocks with CUDA graphs (breakable at attention); "
        "implies --enable-torch-compile; per-request overrides and skip softmax are "
        "then refused",
    )
    offload: str = _field(
        "none",
        one_of(*OFFLOAD_MODES),
        "CPU offload: text_encoder (the encoders visit the GPU only to encode), model (each "
        "component on the GPU only while it runs), group (model, and the DiT streamed to the GPU a "
        "group of blocks at a time, the next group copied while the current one computes)",
    )
    offload_group_blocks: int = _field(
        1, positive_int, "DiT blocks per streamed group with --offload group", metavar="N"
    )
    vae_tiling: bool = _field(
        False, boolean, "VAE encode/decode in overlapping 256-pixel tiles (needed for 720p x 81 frames on most GPUs)"
    )
    vae_slicing: bool = _field(False, boolean, "VAE encode/decode one sample of a batch at a time")
    lora_path: tuple = _field(
        (),
        lora_specs,
        "load a diffusers / PEFT-format Wan LoRA (a .safetensors file, or a folder with "
        "pytorch_lora_weights.safetensors; also the original Wan layout of step-distill "
        "LoRAs, with their .diff / .diff_b deltas) into the DiT; repeat for several. COMPONENT: "
        "transformer (default) or transformer_2 (the low-noise expert of two-expert "
        "checkpoints); SCALE default 1.0. On serve, requests pick adapters by file name with a "
        "'lora' field",
        metavar="[COMPONENT=]PATH[:SCALE]",
    )
    lora_fuse: Optional[bool] = _field(
        None,
        optional(boolean),
        "fuse the LoRAs into the weights (no per-step cost, fixed scales); default "
        "true for generate, false for serve (requests may then change the scales)",
        metavar="true|false",
    )
    dit_quantization: str = _field(
        "none",
        one_of(*DIT_QUANTIZATION),
        "8-bit linear layers for the DiT through torchao (pip install 'ditattn[quant]'), "
        "quantized once at load time: fp8 = e4m3 weights per output channel and "
        "activations per token (the chosen device must be an NVIDIA GPU with compute "
        "capability >= 8.9, --dtype bfloat16); int8 = the same in int8 (CPU or NVIDIA "
        "GPU). The self-attention, cross-attention query/output and feed-forward GEMMs "
        "are quantized; the time and text embeddings, the cross-attention K/V and the "
        "final projection stay in --dtype ('ditattn plan' lists them). Per process, not "
        "per request",
    )
    dit_weights: Union[str, dict, None] = _field(
        None,
        optional(text_or_mapping),
        "take the DiT's weights from this single file instead of the "
        "checkpoint folder's: diffusers or original Wan key names, "
        "bf16/fp16/fp32 or 8-bit with scales (ComfyUI/Kijai *_fp8_scaled, "
        "*_fp8_e4m3fn, LightX2V FP8/INT8), dequantized when loaded; a model "
        "with two DiTs takes transformer=FILE,transformer_2=FILE",
        metavar="FILE.safetensors",
    )


@dataclasses.dataclass(frozen=True)
class AttentionOptions(_Section):
    """The user's attention choices, as given (names and specs are parsed by
    :meth:`RunConfig.attention_settings`)."""

    attention_backend: Optional[str] = _field(
        None,
        optional(plain_name),
        "global attention backend (see 'ditattn backends'; fa3/fa4 -> fa, "
        "cudnn_sdpa -> torch_cudnn_sdpa). For the DiT it is strict: a backend "
        "that cannot serve a layer is an error, except where the platform "
        "substitutes one ('ditattn backends' and the plan say so): fa runs "
        "torch_sdpa without a FlashAttention runtime (on the CPU always), "
        "sage_attn runs fa on Hopper for calls only an unfixed sageattention "
        "package could serve, fp8_fa_sm120 runs torch_cudnn_sdpa off SM120, "
        "and a sparse backend leaves cross-attention to a dense one. Auxiliary "
        "components (text encoder, VAE) fall back when incompatible. With "
        "--backend diffusers it is passed to diffusers' set_attention_backend",
        metavar="NAME",
    )
    component_attention_backends: Union[str, dict, None] = _field(
        None,
        optional(text_or_mapping),
        "per-component overrides: "
        "text_encoder=torch_sdpa,transformer.cross=fa or a "
        "JSON object; keys are model_index.json module "
        "names, optionally with .self/.cross/.cross_image",
        metavar="SPEC",
    )
    attention_backend_config: Union[str, dict, None] = _field(
        None,
        optional(text_or_mapping),
        "backend parameters: a .json/.yaml file, a JSON "
        "object, or k=v,k=v pairs (kernel choices too, e.g. "
        "impl=triton,pv_dtype=fp8 for sage_attn; 'ditattn "
        "backends' lists every key)",
        metavar="CFG",
    )
    attention_backend_override: Optional[str] = _field(
        None,
        optional(plain_name),
        "request-scoped backend for the DiT denoise loop: fa, torch_sdpa, sage_attn, sage_attn_3",
        metavar="NAME",
    )
    enable_attention_backend_autotune: bool = _field(
        False,
        boolean,
        "time compatible candidates per automatically chosen layer on "
        "its first large input and switch when one is faster and agrees "
        "numerically",
    )
    skip_softmax_threshold_scale_factor: Optional[float] = _field(
        None,
        optional(float_between(0.0, 1e6, lo_open=True)),
        "request-scoped skip softmax (BLASST): tiles with "
        "estimated mass below X/context_length are "
        "skipped; no default, calibrate per model",
        metavar="X",
    )
    skip_softmax_start_step: Optional[int] = _field(
        None,
        optional(int_between(0, MAX_STEPS)),
        "zero-based denoising step where skip softmax starts (default 0)",
        metavar="N",
    )

    def skip_softmax(self) -> Optional[dict]:
        """``{threshold_scale_factor, start_step}`` or None; a start step without a threshold is an error."""
        if self.skip_softmax_threshold_scale_factor is None:
            if self.skip_softmax_start_step is not None:
                raise AttentionConfigError(
                    "--skip-softmax-start-step needs --skip-softmax-threshold-scale-factor (no default threshold: "
                    "calibrate it per model)"
                )
            return None
        start = self.skip_softmax_start_step
        return {
            "threshold_scale_factor": self.skip_softmax_threshold_scale_factor,
            "start_step": 0 if start is None else start,
        }

    def given(self) -> list[str]:
        """The names of the options that were set (not None / False)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]


@dataclasses.dataclass(frozen=True)
class ParallelConfig(_Section):
    """Parallelism: ``num_gpus`` ranks as a Ulysses × ring grid, or two of them (one per guidance half)
    with ``cfg_parallel``; ``vae_parallel`` spreads the VAE decode's tiles over all ranks."""

    num_gpus: int = _field(1, int_between(1, MAX_GPUS), "processes for sequence parallelism", metavar="N")
    ulysses_degree: Optional[int] = _field(
        None, optional(int_between(1, MAX_GPUS)), "Ulysses degree (default: the rest of --num-gpus)", metavar="U"
    )
    ring_degree: Optional[int] = _field(
        None,
        optional(int_between(1, MAX_GPUS)),
        "ring-attention degree (default: the rest of --num-gpus)",
        metavar="R",
    )
    cfg_parallel: bool = _field(
        False,
        boolean,
        "run the conditional and unconditional guidance passes on two halves "
        "of the ranks (num_gpus = 2 × ulysses × ring; needs guidance scale > 1)",
    )
    vae_parallel: bool = _field(
        False,
        boolean,
        "split the VAE decode into tiles spread over the ranks (the result "
        "equals --vae-tiling's one-device decode; needs num_gpus >= 2)",
    )

    def degrees(self) -> tuple[int, int]:
        """``(ulysses, ring)`` of each sequence-parallel group, with ``cfg × ulysses × ring ==
        num_gpus`` (``cfg``: :meth:`cfg_degree`); AttentionConfigError otherwise."""
        from ditattn.distributed.cfg import resolve_parallel

        _, u, r = resolve_parallel(
            self.num_gpus,
            self.ulysses_degree,
            self.ring_degree,
            cfg_parallel=self.cfg_parallel,
            vae_parallel=self.vae_parallel,
        )
        return u, r

    def cfg_degree(self) -> int:
        """2 with ``cfg_parallel`` (the guidance halves on two groups of ranks), else 1."""
        return 2 if self.cfg_parallel else 1


@dataclasses.dataclass(frozen=True)
class OutputConfig(_Section):
    """Where ``generate`` writes its MP4 (clips) or PNG (one frame).

    output_path: a folder, or a file path when it ends in ``.mp4`` / ``.png``; an existing file is
    never replaced unless ``overwrite`` (a ``_1``, ``_2``, ... suffix is added instead)."""

    output_path: str = _field(
        "outputs",
        nonempty_text,
        "output directory, or the output file itself when it ends in .mp4 (clips) / .png (one frame)",
        metavar="PATH",
    )
    output_file: Optional[str] = _field(
        None, optional(nonempty_text), "output file name (default derived from the prompt)", metavar="NAME"
    )
    save_output: bool = _field(True, boolean, "write the output file")
    fps: Optional[int] = _field(
        None,
        optional(int_between(1, MAX_FPS)),
        "frames per second of the MP4 (default 16; videos only)",
        metavar="FPS",
    )
    overwrite: bool = _field(
        False, boolean, "replace an existing output file (default: keep it and add a numeric suffix, _1, _2, ...)"
    )


SECTIONS = {
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "attention": AttentionOptions,
    "cache": CacheOptions,
    "parallel": ParallelConfig,
    "output": OutputConfig,
    "server": ServerConfig,
    "simulation": SimulationConfig,
    "compare": CompareOptions,
    "backends": BackendsOptions,
    "calibrate": CalibrateOptions,
}
TOP_LEVEL = ("verbose", "json")


def _section(cls):
    return dataclasses.field(default_factory=cls)


@functools.lru_cache(maxsize=None)  # the sections are fixed: built once (a parser asks ~650 times)
def _keys(accept: Optional[frozenset]) -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for section, cls in SECTIONS.items():
        if accept is None or section in accept:
            out.update({f.name: section for f in dataclasses.fields(cls)})
    out.update({k: None for k in TOP_LEVEL if accept is None or k in accept})
    return out


def _accepted(key: str, allowed, shown: str) -> str:
    """What an unknown key's message says is accepted: every key when the list is short, else the
    closest keys and where the whole list is (so a message stays a readable line)."""
    import difflib

    if len(shown) <= 600:
        return f"accepted: {shown}"
    close = difflib.get_close_matches(key, list(allowed), n=3)
    hint = f"did you mean {', '.join(flag_name(c) for c in close)}? " if close else ""
    return f"{hint}accepted: {len(allowed)} keys, the long flag names of the command's --help without the dashes"


def flag_name(key: str) -> str:
    """``num_inference_steps`` → ``num-inference-steps`` (how keys are shown in messages)."""
    return key.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run of a ``ditattn`` command; see the module docstring."""

    model: ModelConfig = _section(ModelConfig)
    sampling: SamplingConfig = _section(SamplingConfig)
    attention: AttentionOptions = _section(AttentionOptions)
    cache: CacheOptions = _section(CacheOptions)
    parallel: ParallelConfig = _section(ParallelConfig)
    output: OutputConfig = _section(OutputConfig)
    server: ServerConfig = _section(ServerConfig)
    simulation: SimulationConfig = _section(SimulationConfig)
    compare: CompareOptions = _section(CompareOptions)
    backends: BackendsOptions = _section(BackendsOptions)
    calibrate: CalibrateOptions = _section(CalibrateOptions)
    verbose: bool = False
    json: bool = False

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise AttentionConfigError(
                    f"RunConfig.{name} must be a {cls.__name__}, got {short_repr(getattr(self, name))}"
                )
        for name in TOP_LEVEL:
            try:
                object.__setattr__(self, name, boolean(getattr(self, name)))
            except ValueError as exc:
                raise AttentionConfigError(f"{name}: {exc}") from None

    # -- building ---------------------------------------------------------------------------------
    @staticmethod
    def keys(accept: Optional[Iterable[str]] = None) -> dict[str, Optional[str]]:
        """Every settable key → its section (None for ``verbose`` / ``json``), limited to the
        sections and top-level keys named in ``accept`` (None: all)."""
        return dict(_keys(None if accept is None else frozenset(accept)))  # a copy: the callers' own

    @classmethod
    def from_mapping(
        cls,
        values: Mapping[str, Any],
        *,
        base: Optional["RunConfig"] = None,
        accept: Optional[Iterable[str]] = None,
        source: str = "config",
    ) -> "RunConfig":
        """``base`` (default: all defaults) with the flat ``values`` applied on top.

        Keys are field names or long flag names (``num_inference_steps``, ``num-inference-steps``,
        ``--num-inference-steps``); ``accept`` limits them to some sections / top-level keys (a
        command's); values are checked like the flags' (text such as ``"4"`` is converted).
        Unknown keys, keys outside ``accept`` and bad values raise :class:`AttentionConfigError`
        prefixed with ``source``.
        """
        if not isinstance(values, Mapping):
            raise AttentionConfigError(f"{source}: expected a mapping of settings, got {type(values).__name__}")
        known, allowed = cls.keys(), cls.keys(accept)
        shown = ", ".join(sorted(flag_name(k) for k in allowed))
        changes: dict[Optional[str], dict] = {}
        for raw, value in values.items():
            key = str(raw).lstrip("-").replace("-", "_")
            if key not in known:
                raise AttentionConfigError(
                    f"{source}: unknown key {short_repr(raw)}; {_accepted(key, allowed, shown)}"
                )
            if key not in allowed:
                where = f"the {known[key]} settings" if known[key] else "other commands"
                raise AttentionConfigError(
                    f"{source}: key {short_repr(raw)} does not apply here (it belongs to {where}); accepted: {shown}"
                )
            section = known[key]
            check = (
                boolean
                if section is None
                else next(f.metadata["check"] for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
            )
            if key in changes.get(section, {}):
                raise AttentionConfigError(
                    f"{source}: {flag_name(key)} is given twice ({short_repr(raw)} repeats an earlier spelling of "
                    "it); give it once"
                )
            try:
                changes.setdefault(section, {})[key] = check(value)
            except ValueError as exc:
                shown_key = ("--" if source == "command line" else "") + flag_name(key)
                raise AttentionConfigError(f"{source}: {shown_key}: {exc}") from None
        base = base or cls()
        top = changes.pop(None, {})
        sections = {s: dataclasses.replace(getattr(base, s), **kw) for s, kw in changes.items()}
        return dataclasses.replace(base, **sections, **top)

    @classmethod
    def from_file(
        cls, path: str, *, base: Optional["RunConfig"] = None, accept: Optional[Iterable[str]] = None
    ) -> "RunConfig":
        """:meth:`from_mapping` of the YAML / JSON mapping in ``path``."""
        from ditattn.attention.config import load_mapping_file

        data = load_mapping_file(
            path,
            what="config file",
            accepted="a YAML mapping of long flag names to values, e.g. 'num-inference-steps: 4'",
        )
        return cls.from_mapping(data, base=base, accept=accept, source=f"config file {short_text(path)}")

    # -- what the layers below take ---------------------------------------------------------------
    def attention_settings(self):
        """The :class:`~ditattn.attention.context.AttentionSettings` of this run (parses backend
        names, component overrides and the backend config; raises AttentionConfigError)."""
        from ditattn.attention.config import parse_attention_backend_config, parse_component_overrides
        from ditattn.attention.context import AttentionSettings
        from ditattn.attention.names import AttentionBackendEnum

        a, m = self.attention, self.model
        u, r = self.parallel.degrees()
        return AttentionSettings(
            backend=AttentionBackendEnum.from_name(a.attention_backend) if a.attention_backend else None,
            component_overrides=parse_component_overrides(a.component_attention_backends),
            config=parse_attention_backend_config(a.attention_backend_config),
            autotune=a.enable_attention_backend_autotune,
            ring_degree=r,
            ulysses_degree=u,
            compiled=m.enable_torch_compile or m.enable_cuda_graph,
            cuda_graphs=m.enable_cuda_graph,
        )

    def ignored_settings(self) -> list[str]:
        """Settings this run was given that would have no effect, one sentence each (the commands print them
        as ``warning:`` lines, so that nothing given is silently ignored): guidance-only settings without
        classifier-free guidance, ``offload_group_blocks`` without ``offload group``, ``lora_fuse``
        without a LoRA, skip softmax starting after the last step, a shared-store setting without one."""
        out = []
        s, m = self.sampling, self.model
        if s.guidance_scale is not None and s.guidance_scale <= 1.0:
            given = [f for f, on in (("negative-prompt", s.negative_prompt is not None),
                                     ("cfg-interval", s.cfg_interval is not None),
                                     ("cfg-batching", s.cfg_batching != "auto")) if on]  # fmt: skip
            if given:
                out.append(
                    f"--{', --'.join(given)} only act(s) with classifier-free guidance, which "
                    f"--guidance-scale {s.guidance_scale:g} (<= 1) turns off"
                )
        if m.offload_group_blocks != 1 and m.offload != "group":
            out.append(f"--offload-group-blocks {m.offload_group_blocks} acts only with --offload group")
        if m.lora_fuse is not None and not m.lora_path:
            out.append("--lora-fuse acts only with --lora-path")
        a = self.attention
        steps = len(s.timesteps) if s.timesteps else s.num_inference_steps
        if a.skip_softmax_start_step is not None and steps is not None and a.skip_softmax_start_step >= steps:
            out.append(
                f"--skip-softmax-start-step {a.skip_softmax_start_step} is past the last of the run's {steps} steps: "
                "nothing is skipped"
            )
        o = self.output
        if o.overwrite and not o.save_output:
            out.append("--overwrite acts only when the output is saved (--no-save-output is given)")
        if m.local_files_only and (m.model_path or "ditattn:").startswith("ditattn:"):
            out.append("--local-files-only acts only for Hugging Face repo ids; built-in ditattn: models are local")
        sim = self.simulation
        if sim.platform and m.device and not str(sim.platform).split(":")[0] == str(m.device).split(":")[0]:
            out.append(
                f"--device {m.device} is not used with --platform {sim.platform}: the simulated platform decides the "
                "device the plan shows"
            )
        sv = self.server
        shared = bool(sv.job_store) and sv.job_store != "sqlite"
        defaults = ServerConfig()
        if not shared:
            for name in ("job_lease_s", "job_max_attempts"):
                if getattr(sv, name) != getattr(defaults, name):
                    out.append(f"--{name.replace('_', '-')} acts only with a shared --job-store postgresql://...")
        if sv.replica_process != defaults.replica_process and sv.replicas == 1 and not sv.ray_address:
            out.append("--replica-process acts only on Ray Serve (--replicas N > 1, or --ray-address)")
        return out

    def generate_kwargs(self) -> dict:
        """Keyword arguments of ``WanPipelineNative.generate`` for this run: the sampling fields
        (None = the model's default; seed None = 0), the request override and skip softmax."""
        s = self.sampling
        return dict(
            prompt=s.prompt,
            negative_prompt=s.negative_prompt,
            height=s.height,
            width=s.width,
            num_frames=s.num_frames,
            num_inference_steps=s.num_inference_steps,
            guidance_scale=s.guidance_scale,
            guidance_scale_2=s.guidance_scale_2,
            image=s.image,
            seed=s.seed or 0,
            scheduler=s.scheduler,
            flow_shift=s.flow_shift,
            timesteps=s.timesteps,
            cfg_interval=s.cfg_interval,
            cfg_batching=s.cfg_batching,
            override=self.attention.attention_backend_override,
            skip_softmax=self.attention.skip_softmax(),
        )

    def for_rank(self, rank: int, device: str) -> "RunConfig":
        """This run as rank ``rank`` of a sequence-parallel job runs it: on ``device``, with the
        degrees resolved, and only rank 0 writing output."""
        u, r = self.parallel.degrees()
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, device=device),
            parallel=dataclasses.replace(self.parallel, ulysses_degree=u, ring_degree=r),
            output=self.output if rank == 0 else dataclasses.replace(self.output, save_output=False),
        )
