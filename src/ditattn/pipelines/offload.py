"""Where a pipeline's components live between uses: CPU offload for checkpoints that do not fit the
accelerator whole (a Wan 14B DiT is 28 GB in bf16, its UMT5-XXL text encoder 11 GB more).

Modes (``--offload``):

* ``none`` — every component stays on the device.
* ``text_encoder`` — the text and image encoders live on the CPU and visit the device only while
  they encode; the DiT and the VAE stay on the device.
* ``model`` — every component lives on the CPU and is moved to the device when it runs; it stays
  there until another component needs the device (so the DiT stays for the whole denoise loop),
  and everything leaves at the end of a generation.
* ``group`` — ``model``, and the DiT itself is streamed: only its non-block weights stay on the
  device while it runs; its blocks come over ``group_blocks`` at a time right before they run and
  leave right after, the next group copied on a side CUDA stream while the current one computes.

The CPU copies are the masters (pinned on CUDA machines, so copies are asynchronous): moving a
component to the device copies its tensors there, moving it back only drops the device copies
(inference never changes weights).  Stages of the pipeline ask for a component with
:meth:`ComponentPlacement.use`; the DiT's blocks move through forward hooks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from ditattn.attention.names import DIT_COMPONENTS as DIT
from ditattn.errors import AttentionConfigError
from ditattn.runconfig import OFFLOAD_MODES

log = logging.getLogger("ditattn.pipeline")

ENCODERS = ("text_encoder", "image_encoder")


def check_offload_mode(mode: str) -> None:
    """Raise :class:`AttentionConfigError` unless ``mode`` is one of :data:`OFFLOAD_MODES`."""
    if mode not in OFFLOAD_MODES:
        raise AttentionConfigError(f"unknown offload mode {mode!r}; accepted: {', '.join(OFFLOAD_MODES)}")


class _Weights:
    """The parameters and buffers of some modules, with CPU master copies; ``onload`` points them at
    device copies, ``offload`` back at the masters."""

    def __init__(self, modules: Iterable[nn.Module], *, recurse: bool, pin: bool):
        seen, self.tensors = set(), []
        for m in modules:
            for t in list(m.parameters(recurse=recurse)) + list(m.buffers(recurse=recurse)):
                if id(t) not in seen:
                    seen.add(id(t))
                    self.tensors.append(t)
        self.masters = []
        for t in self.tensors:
            cpu = t.data.to("cpu")
            if pin and not cpu.is_pinned():
                cpu = cpu.pin_memory()
            t.data = cpu
            self.masters.append(cpu)
        self.device: Optional[torch.device] = None

    def onload(self, device: torch.device, stream=None) -> None:
        if self.device == device:
            return
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for t, cpu in zip(self.tensors, self.masters):
                t.data = cpu.to(device, non_blocking=True)
        self.device = device

    def record(self, stream) -> None:
        """Keep the device copies (made on a side stream) alive until ``stream``'s queued work ends."""
        for t in self.tensors:
            if t.data.is_cuda:
                t.data.record_stream(stream)

    def offload(self) -> None:
        for t, cpu in zip(self.tensors, self.masters):
            t.data = cpu
        self.device = None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.masters)


class _BlockStreamer:
    """Forward hooks that stream a DiT's ``blocks`` through the device ``group`` blocks at a time,
    the next group prefetched on a side stream (CUDA) while the current group runs."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device, group: int, pin: bool):
        self.device, self.blocks = device, list(blocks)
        self.groups = [
            _Weights(self.blocks[i : i + group], recurse=True, pin=pin) for i in range(0, len(self.blocks), group)
        ]
        self.group_of = {id(b): i // group for i, b in enumerate(self.blocks)}
        self.last_of = {g: min((g + 1) * group, len(self.blocks)) - 1 for g in range(len(self.groups))}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, object] = {}  # group -> CUDA event of its copy
        self.active = False
        self.handles = []
        for i, b in enumerate(self.blocks):
            self.handles.append(b.register_forward_pre_hook(lambda m, args, i=i: self._before(i)))
            self.handles.append(b.register_forward_hook(lambda m, args, out, i=i: self._after(i)))

    def _fetch(self, g: int) -> None:
        if self.groups[g].device is not None:
            return
        if self.stream is None:
            self.groups[g].onload(self.device)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.groups[g].onload(self.device, self.stream)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.ready[g] = ev

    def _before(self, i: int) -> None:
        if not self.active:
            return
        g = self.group_of[id(self.blocks[i])]
        self._fetch(g)
        ev = self.ready.pop(g, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self.groups[g].record(torch.cuda.current_stream(self.device))
        self._fetch((g + 1) % len(self.groups))  # overlap the next group's copy with this one's compute

    def _after(self, i: int) -> None:
        if not self.active:
            return
        g = self.group_of[id(self.blocks[i])]
        if i == self.last_of[g] and len(self.groups) > 1:
            self.groups[g].offload()

    def resident(self) -> set[int]:
        """Indices of the blocks whose weights are on the device now."""
        return {i for i, b in enumerate(self.blocks) if self.groups[self.group_of[id(b)]].device is not None}

    def release(self) -> None:
        self.ready.clear()
        for w in self.groups:
            w.offload()


class ComponentPlacement:
    """Moves ``components`` between the CPU and ``device`` under ``mode`` (:data:`OFFLOAD_MODES`).

    Call :meth:`use` around every stage that runs a component (``with placement.use("vae"): ...``) and
    :meth:`release` at the end of a generation.  ``group_blocks``: DiT blocks per streamed group
    (``group`` mode).  In ``none`` mode every call is a no-op.
    """

    def __init__(self, components: dict, device: torch.device, mode: str = "none", group_blocks: int = 1):
        check_offload_mode(mode)
        if not isinstance(group_blocks, int) or isinstance(group_blocks, bool) or group_blocks < 1:
            raise AttentionConfigError(f"offload group_blocks must be a positive integer, got {group_blocks!r}")
        self.device, self.mode, self.group_blocks = device, mode, group_blocks
        self.weights: dict[str, _Weights] = {}
        self.streamers: dict[str, _BlockStreamer] = {}
        self.current: Optional[str] = None  # model / group: the component on the device now
        if mode == "none":
            return
        if device.type == "cpu":  # the schedule runs (the CPU is the reference for it) but moves nothing
            log.warning(
                "--offload %s saves no memory on the CPU: every component already runs from CPU memory "
                "(offloading is for an accelerator device)",
                mode,
            )
        blocks = max((len(getattr(m, "blocks", ())) for n, m in components.items() if n in DIT), default=0)
        if mode == "group" and blocks and group_blocks >= blocks:
            log.warning(
                "--offload-group-blocks %d streams the whole DiT (%d blocks) as one group: no saving over "
                "--offload model; accepted: fewer blocks than the DiT has",
                group_blocks,
                blocks,
            )
        pin = device.type == "cuda"
        for name, module in components.items():
            if not isinstance(module, nn.Module):
                continue
            if mode == "text_encoder" and name not in ENCODERS:
                module.to(device)
                continue
            if mode == "group" and name in DIT and hasattr(module, "blocks"):
                self.streamers[name] = _BlockStreamer(module.blocks, device, group_blocks, pin)
                shell = [m for n, m in module.named_modules() if n != "blocks" and not n.startswith("blocks.")]
                self.weights[name] = _Weights(shell, recurse=False, pin=pin)
            else:
                self.weights[name] = _Weights([module], recurse=True, pin=pin)
        log.info(
            "offload %s: %s on the CPU (%.1f GB)",
            mode,
            ", ".join(self.offloaded),
            sum(w.nbytes for w in self.weights.values()) / 1e9
            + sum(g.nbytes for s in self.streamers.values() for g in s.groups) / 1e9,
        )

    @property
    def offloaded(self) -> list[str]:
        """The components whose home is the CPU."""
        return list(self.weights)

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """``name`` is on the device inside the block (``text_encoder`` mode: only there; ``model`` /
        ``group``: until another component needs the device, or :meth:`release`)."""
        self.onload(name)
        try:
            yield
        finally:
            if self.mode == "text_encoder" and name in self.weights:
                self.weights[name].offload()

    def onload(self, name: str) -> None:
        """Move ``name`` to the device (``model`` / ``group``: moving the current one off first; a DiT
        in ``group`` mode: its non-block weights, its blocks then stream through their hooks)."""
        w = self.weights.get(name)
        if w is None:
            return
        if self.mode != "text_encoder" and self.current not in (None, name):
            self._evict(self.current)
        w.onload(self.device)
        if self.mode != "text_encoder":
            self.current = name
        if name in self.streamers:
            self.streamers[name].active = True

    def _evict(self, name: str) -> None:
        self.weights[name].offload()
        if name in self.streamers:
            self.streamers[name].active = False
            self.streamers[name].release()
        if self.current == name:
            self.current = None

    def release(self) -> None:
        """Every offloaded component back to the CPU (end of a generation)."""
        for name in list(self.weights):
            self._evict(name)

    def resident(self) -> set[str]:
        """The offloaded components whose (non-streamed) weights are on the device now."""
        return {n for n, w in self.weights.items() if w.device is not None}

    def resident_blocks(self, name: str) -> set[int]:
        """``group`` mode: the blocks of DiT ``name`` on the device now."""
        s = self.streamers.get(name)
        return s.resident() if s is not None else set()
