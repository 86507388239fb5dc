"""The typed run configuration: what a ``ditattn`` command runs, built once and passed down.

:class:`RunConfig` holds one of each section:

* :class:`ModelConfig` — what to load, on which device and dtype, compiled or not;
* :class:`SamplingConfig` — prompt and sampling (size, frames, steps, guidance, seed);
* :class:`AttentionOptions` — the user's attention choices (become
  :class:`~ditattn.attention.context.AttentionSettings` through :meth:`RunConfig.attention_settings`);
* :class:`ParallelConfig` — sequence parallelism (``num_gpus = ulysses_degree × ring_degree``);
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
from typing import Any, Iterable, Mapping, Optional, Union

from ditattn.errors import AttentionConfigError, short_repr, short_text
from ditattn.runconfig.checks import (
    boolean,
    float_between,
    int_between,
    lora_specs,
    one_of,
    optional,
    plain_name,
    positive_int,
    text,
    text_or_mapping,
)
from ditattn.runconfig.commands import CompareOptions, ServerConfig, SimulationConfig
from ditattn.runconfig.fields import MAX_FPS, MAX_FRAMES, MAX_GPUS, MAX_GUIDANCE, MAX_SEED, MAX_SIDE, MAX_STEPS
from ditattn.runconfig.fields import Section as _Section  # the short names the sections below use
from ditattn.runconfig.fields import setting as _field


# ------------------------------------------------------------------------------------------------
# sections

DTYPES = ("float32", "bfloat16", "float16")
#: where components live between uses (ditattn.pipelines.offload)
OFFLOAD_MODES = ("none", "text_encoder", "model", "group")
DIT_QUANTIZATION = ("none", "fp8", "int8")  # ditattn.models.quantization.MODES


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    """What to load and how to run it."""

    model_path: Optional[str] = _field(None, optional(text), "local diffusers-format Wan folder, Hugging Face repo id "
                                       "org/name, or a built-in model: ditattn:shapes, ditattn:tiny-wan, "
                                       "ditattn:tiny-wan2.2 (None: the default, ditattn.models.builtin.DEFAULT_MODEL)")
    revision: Optional[str] = _field(None, optional(text), "branch, tag or commit of a Hugging Face repo id")
    local_files_only: bool = _field(False, boolean, "resolve a Hugging Face repo id from the local cache only")
    model_variant: Optional[str] = _field(None, optional(text), "weights variant of checkpoints that have several")
    device: Optional[str] = _field(None, optional(plain_name), "cpu, cuda, cuda:1, ... (None: cuda if available, else cpu)")
    dtype: Optional[str] = _field(None, optional(one_of(*DTYPES)), "compute dtype (None: float32 on cpu, bfloat16 on "
                                  "GPUs)")
    backend: str = _field("native", one_of("native", "diffusers"), "native ditattn pipeline or stock diffusers")
    enable_torch_compile: bool = _field(False, boolean, "torch.compile each DiT block")
    enable_cuda_graph: bool = _field(False, boolean, "CUDA graphs for the DiT blocks (implies torch.compile)")
    offload: str = _field("none", one_of(*OFFLOAD_MODES), "CPU offload: none, text_encoder (encoders visit the device "
                          "only to encode), model (each component on the device only while it runs), group (model, "
                          "and the DiT streamed block group by block group)")
    offload_group_blocks: int = _field(1, positive_int, "DiT blocks per streamed group (--offload group)")
    vae_tiling: bool = _field(False, boolean, "VAE encode/decode in overlapping spatial tiles (less memory)")
    vae_slicing: bool = _field(False, boolean, "VAE encode/decode one sample of the batch at a time")
    lora_path: tuple = _field((), lora_specs, "LoRA adapters: [COMPONENT=]PATH[:SCALE] each (COMPONENT transformer or "
                              "transformer_2, default transformer; SCALE default 1.0)")
    lora_fuse: Optional[bool] = _field(None, optional(boolean), "fuse the LoRAs into the weights (None: generate "
                                       "fuses, serve keeps them apart so requests can set their scales)")
    dit_quantization: str = _field("none", one_of(*DIT_QUANTIZATION), "8-bit DiT linears through torchao: fp8 "
                                   "(CUDA SM >= 8.9, bfloat16) or int8; per process, not per request")
    dit_weights: Union[str, dict, None] = _field(None, optional(text_or_mapping), "a .safetensors file of DiT weights "
                                                 "instead of the checkpoint's (FP8/INT8 with scales too), or "
                                                 "transformer=FILE,transformer_2=FILE")


@dataclasses.dataclass(frozen=True)
class SamplingConfig(_Section):
    """Prompt and sampling; None takes the model's default (``serve``: the default of requests)."""

    prompt: Optional[str] = _field(None, optional(text), "text prompt")
    negative_prompt: Optional[str] = _field(None, optional(text), "negative prompt for classifier-free guidance")
    num_inference_steps: Optional[int] = _field(None, optional(int_between(1, MAX_STEPS)), "denoising steps")
    guidance_scale: Optional[float] = _field(None, optional(float_between(0.0, MAX_GUIDANCE)),
                                             "classifier-free guidance scale (> 1 enables guidance)")
    guidance_scale_2: Optional[float] = _field(None, optional(float_between(0.0, MAX_GUIDANCE)),
                                               "guidance scale of the low-noise expert (two-expert Wan 2.2 "
                                               "checkpoints; None: guidance_scale)")
    image: Optional[str] = _field(None, optional(text), "first frame of an image-to-video / TI2V checkpoint (a PNG, "
                                  "JPEG, WebP or BMP file)")
    height: Optional[int] = _field(None, optional(int_between(1, MAX_SIDE)), "output height in pixels")
    width: Optional[int] = _field(None, optional(int_between(1, MAX_SIDE)), "output width in pixels")
    num_frames: Optional[int] = _field(None, optional(int_between(1, MAX_FRAMES)), "frames (1 = image)")
    seed: Optional[int] = _field(None, optional(int_between(0, MAX_SEED)), "random seed (None: 0 for generate; serve "
                                 "refuses it, requests carry their own)")


@dataclasses.dataclass(frozen=True)
class AttentionOptions(_Section):
    """The user's attention choices, as given (names and specs are parsed by
    :meth:`RunConfig.attention_settings`)."""

    attention_backend: Optional[str] = _field(None, optional(plain_name), "global attention backend")
    component_attention_backends: Union[str, dict, None] = _field(None, optional(text_or_mapping),
                                                                  "per-component overrides: a spec or a mapping")
    attention_backend_config: Union[str, dict, None] = _field(None, optional(text_or_mapping),
                                                              "backend parameters: a file, JSON, k=v pairs or a mapping")
    attention_backend_override: Optional[str] = _field(None, optional(plain_name), "request-scoped DiT backend")
    enable_attention_backend_autotune: bool = _field(False, boolean, "time candidates per automatic layer")
    skip_softmax_threshold_scale_factor: Optional[float] = _field(None, optional(float_between(0.0, 1e6, lo_open=True)),
                                                                  "request-scoped skip softmax threshold scale")
    skip_softmax_start_step: Optional[int] = _field(None, optional(int_between(0, MAX_STEPS)),
                                                    "first skip-softmax step (default 0)")

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
        return {"threshold_scale_factor": self.skip_softmax_threshold_scale_factor,
                "start_step": 0 if start is None else start}

    def given(self) -> list[str]:
        """The names of the options that were set (not None / False)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]


@dataclasses.dataclass(frozen=True)
class ParallelConfig(_Section):
    """Sequence parallelism: ``num_gpus`` ranks as a Ulysses × ring grid."""

    num_gpus: int = _field(1, int_between(1, MAX_GPUS), "processes for sequence parallelism")
    ulysses_degree: Optional[int] = _field(None, optional(int_between(1, MAX_GPUS)),
                                           "Ulysses degree (None: the rest of num_gpus)")
    ring_degree: Optional[int] = _field(None, optional(int_between(1, MAX_GPUS)), "ring-attention degree (None: the rest)")

    def degrees(self) -> tuple[int, int]:
        """``(ulysses, ring)`` with ``ulysses × ring == num_gpus`` (AttentionConfigError otherwise)."""
        from ditattn.distributed.groups import resolve_degrees

        return resolve_degrees(self.num_gpus, self.ulysses_degree, self.ring_degree)


@dataclasses.dataclass(frozen=True)
class OutputConfig(_Section):
    """Where ``generate`` writes its MP4 (clips) or PNG (one frame).

    output_path: a folder, or a file path when it ends in ``.mp4`` / ``.png``; an existing file is
    never replaced unless ``overwrite`` (a ``_1``, ``_2``, ... suffix is added instead)."""

    output_path: str = _field("outputs", text, "output directory, or a file path ending in .mp4 / .png")
    output_file: Optional[str] = _field(None, optional(text), "output file name (None: derived from the prompt)")
    save_output: bool = _field(True, boolean, "write the output file")
    fps: Optional[int] = _field(None, optional(int_between(1, MAX_FPS)), "frames per second of the MP4 (None: 16)")
    overwrite: bool = _field(False, boolean, "replace an existing output file (default: add a numeric suffix)")


SECTIONS = {"model": ModelConfig, "sampling": SamplingConfig, "attention": AttentionOptions,
            "parallel": ParallelConfig, "output": OutputConfig, "server": ServerConfig,
            "simulation": SimulationConfig, "compare": CompareOptions}
TOP_LEVEL = ("verbose", "json")


def _section(cls):
    return dataclasses.field(default_factory=cls)


def flag_name(key: str) -> str:
    """``num_inference_steps`` → ``num-inference-steps`` (how keys are shown in messages)."""
    return key.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run of a ``ditattn`` command; see the module docstring."""

    model: ModelConfig = _section(ModelConfig)
    sampling: SamplingConfig = _section(SamplingConfig)
    attention: AttentionOptions = _section(AttentionOptions)
    parallel: ParallelConfig = _section(ParallelConfig)
    output: OutputConfig = _section(OutputConfig)
    server: ServerConfig = _section(ServerConfig)
    simulation: SimulationConfig = _section(SimulationConfig)
    compare: CompareOptions = _section(CompareOptions)
    verbose: bool = False
    json: bool = False

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise AttentionConfigError(f"RunConfig.{name} must be a {cls.__name__}, "
                                           f"got {short_repr(getattr(self, name))}")
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
        accept = None if accept is None else set(accept)
        out: dict[str, Optional[str]] = {}
        for section, cls in SECTIONS.items():
            if accept is None or section in accept:
                out.update({f.name: section for f in dataclasses.fields(cls)})
        out.update({k: None for k in TOP_LEVEL if accept is None or k in accept})
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: Optional["RunConfig"] = None,
                     accept: Optional[Iterable[str]] = None, source: str = "config") -> "RunConfig":
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
                raise AttentionConfigError(f"{source}: unknown key {short_repr(raw)}; accepted: {shown}")
            if key not in allowed:
                where = f"the {known[key]} settings" if known[key] else "other commands"
                raise AttentionConfigError(f"{source}: key {short_repr(raw)} does not apply here (it belongs to "
                                           f"{where}); "
                                           f"accepted: {shown}")
            section = known[key]
            check = boolean if section is None else next(
                f.metadata["check"] for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
            try:
                changes.setdefault(section, {})[key] = check(value)
            except ValueError as exc:
                raise AttentionConfigError(f"{source}: {flag_name(key)}: {exc}") from None
        base = base or cls()
        top = changes.pop(None, {})
        sections = {s: dataclasses.replace(getattr(base, s), **kw) for s, kw in changes.items()}
        return dataclasses.replace(base, **sections, **top)

    @classmethod
    def from_file(cls, path: str, *, base: Optional["RunConfig"] = None,
                  accept: Optional[Iterable[str]] = None) -> "RunConfig":
        """:meth:`from_mapping` of the YAML / JSON mapping in ``path``."""
        from ditattn.attention.config import load_mapping_file

        data = load_mapping_file(path, what="config file",
                                 accepted="a YAML mapping of long flag names to values, e.g. 'num-inference-steps: 4'")
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

    def generate_kwargs(self) -> dict:
        """Keyword arguments of ``WanPipelineNative.generate`` for this run: the sampling fields
        (None = the model's default; seed None = 0), the request override and skip softmax."""
        s = self.sampling
        return dict(prompt=s.prompt, negative_prompt=s.negative_prompt, height=s.height, width=s.width,
                    num_frames=s.num_frames, num_inference_steps=s.num_inference_steps,
                    guidance_scale=s.guidance_scale, guidance_scale_2=s.guidance_scale_2, image=s.image, seed=s.seed or 0,
                    override=self.attention.attention_backend_override, skip_softmax=self.attention.skip_softmax())

    def for_rank(self, rank: int, device: str) -> "RunConfig":
        """This run as rank ``rank`` of a sequence-parallel job runs it: on ``device``, with the
        degrees resolved, and only rank 0 writing output."""
        u, r = self.parallel.degrees()
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, device=device),
            parallel=dataclasses.replace(self.parallel, ulysses_degree=u, ring_degree=r),
            output=self.output if rank == 0 else dataclasses.replace(self.output, save_output=False))
