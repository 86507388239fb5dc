"""Platforms: what hardware the running PyTorch sees, and simulated platforms for tests.

A :class:`Platform` is plain data (name, device type, compute capability, installed packages), so
tests can build any platform with any capability and package set without the hardware::

    Platform.simulate("cuda", capability=(10, 0), packages={"flash_attn.cute"})

:func:`current_platform` detects the real one once per process (``set_platform`` overrides it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from functools import lru_cache
from typing import Iterable, Iterator

PLATFORM_NAMES = ("cpu", "cuda", "rocm", "xpu", "musa", "mps", "npu")

# Optional runtime packages the backends use, by import name.
KNOWN_PACKAGES = (
    "flash_attn.cute",  # FlashAttention-4 (CuTe DSL)
    "flash_attn_interface",  # FlashAttention-3
    "flash_attn",  # FlashAttention-2
    "sageattention",
    "sageattn3",
    "spas_sage_attn",  # SpargeAttn
    "st_attn",
    "vsa",
    "sol_attn",
    "svg",
    "aiter",
    "sgl_kernel_npu",
    "triton",
    "torchao",  # 8-bit DiT linears (--dit-quantization)
)


@lru_cache(maxsize=None)
def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


@dataclasses.dataclass(frozen=True)
class Platform:
    """One execution platform.

    name: one of ``PLATFORM_NAMES``. device_type: the torch device type (``"cuda"`` for ROCm too).
    capability: ``(major, minor)`` compute capability on CUDA, None elsewhere.
    packages: import names of installed optional runtimes (None = look them up lazily).
    versions: ``(import name, version)`` pairs a simulated platform pins (a real one reads the
    installed distribution's metadata).
    """

    name: str
    device_type: str
    capability: tuple[int, int] | None = None
    device_name: str = ""
    packages: frozenset[str] | None = None
    simulated: bool = False
    versions: tuple[tuple[str, str], ...] = ()

    def has_package(self, module: str) -> bool:
        if self.packages is not None:
            return module in self.packages
        return _module_installed(module)

    def package_version(self, module: str) -> str | None:
        """Version of the distribution behind ``module`` (None: unknown or not installed).

        A build installed from a git checkout carries ``+git.<commit>`` (pip's ``direct_url.json``),
        so rules about one PyPI release can tell the two apart."""
        if self.packages is not None:
            return dict(self.versions).get(module)
        return _installed_version(module)

    def has_any(self, modules: Iterable[str]) -> str | None:
        for m in modules:
            if self.has_package(m):
                return m
        return None

    @property
    def sm(self) -> int | None:
        """Compute capability as an integer (9.0 -> 90), or None."""
        if self.capability is None:
            return None
        return self.capability[0] * 10 + self.capability[1]

    def describe(self) -> str:
        cap = f" SM{self.sm}" if self.sm is not None else ""
        dev = f" ({self.device_name})" if self.device_name else ""
        return f"{self.name}{cap}{dev}"

    def to_json(self) -> dict:
        out = {
            "name": self.name,
            "device": self.device_type,
            "capability": list(self.capability) if self.capability else None,
        }
        if self.simulated:
            out["simulated"] = True
            out["packages"] = sorted(self.packages or ())
        return out

    @classmethod
    def simulate(
        cls,
        name: str,
        capability: tuple[int, int] | None = None,
        packages: Iterable[str] = (),
        device_name: str = "",
    ) -> "Platform":
        """A platform that does not need the hardware: for tests and for ``plan``/``backends
        --platform``. ``packages``: import names, each optionally pinned as ``name==version``."""
        if name not in PLATFORM_NAMES:
            from ditattn.errors import AttentionConfigError, short_repr

            raise AttentionConfigError(
                f"unknown platform {short_repr(name)}; known platforms: {', '.join(PLATFORM_NAMES)}"
            )
        device_type = {"rocm": "cuda"}.get(name, name)
        if name in ("cuda", "rocm") and capability is None:
            capability = (9, 0) if name == "cuda" else (9, 4)
        names, versions = set(), []
        for p in packages:
            mod, _, ver = p.partition("==")
            names.add(mod)
            if ver:
                versions.append((mod, ver))
        return cls(name, device_type, capability, device_name, frozenset(names), True, tuple(sorted(versions)))

    @classmethod
    def from_spec(cls, spec: str, packages: "str | Iterable[str] | None" = None) -> "Platform":
        """A simulated platform from a spec ``NAME[:SM]`` (``cuda:90``, ``cuda:8.6``, ``rocm``,
        ``xpu``, ``npu``, ``musa``, ``mps``, ``cpu``: :func:`parse_platform_spec`) and its packages
        (``"a,b"`` or a list: :func:`parse_platform_packages`; default none) — what ``plan`` /
        ``backends --platform`` simulate.  Raises :class:`AttentionConfigError` naming what is accepted."""
        name, capability = parse_platform_spec(spec)
        return cls.simulate(name, capability, parse_platform_packages(packages))


def parse_platform_spec(spec: str) -> tuple[str, "tuple[int, int] | None"]:
    """``"cuda:90"`` -> ``("cuda", (9, 0))``, ``"xpu"`` -> ``("xpu", None)``: a platform name of
    :data:`PLATFORM_NAMES`, with an SM (``90``, ``sm90``, ``sm_90``, ``9.0``) for cuda only.
    Raises :class:`AttentionConfigError` naming what is accepted."""
    from ditattn.errors import AttentionConfigError, short_repr

    name, _, sm = str(spec).strip().lower().partition(":")
    if name not in PLATFORM_NAMES:
        raise AttentionConfigError(
            f"unknown platform {short_repr(name)}; accepted: {', '.join(PLATFORM_NAMES)}, "
            "with ':SM' for cuda (e.g. cuda:90)"
        )
    if not sm:
        return name, None
    if name != "cuda":
        raise AttentionConfigError(
            f"{short_repr(spec)}: a compute capability applies to cuda only (e.g. cuda:90, cuda:100)"
        )
    return name, _parse_sm(sm)


def parse_platform_packages(packages: "str | Iterable[str] | None") -> tuple[str, ...]:
    """``"flash_attn.cute,sageattention==2.2.0"`` (or a list) -> a tuple of import names from
    :data:`KNOWN_PACKAGES`, each optionally pinned as ``name==version``; raises
    :class:`AttentionConfigError` for an unknown name."""
    from ditattn.errors import AttentionConfigError

    if isinstance(packages, str):
        packages = packages.split(",")
    out = tuple(str(p).strip() for p in packages or () if str(p).strip())
    unknown = [p for p in out if p.partition("==")[0] not in KNOWN_PACKAGES]
    if unknown:
        raise AttentionConfigError(
            f"unknown package(s) {', '.join(unknown)}; accepted: {', '.join(KNOWN_PACKAGES)} "
            "(import names, optionally name==version)"
        )
    return out


def _parse_sm(sm: str) -> tuple[int, int]:
    """``"90"`` / ``"sm90"`` / ``"sm_90"`` / ``"9.0"`` / ``"120"`` -> ``(major, minor)``."""
    from ditattn.errors import AttentionConfigError, short_repr

    text = sm.removeprefix("sm").lstrip("_")
    try:
        if "." in text:
            major, minor = (int(x) for x in text.split(".", 1))
        else:
            major, minor = divmod(int(text), 10)
    except ValueError:
        major = minor = -1
    if not (1 <= major <= 20 and 0 <= minor <= 9):
        raise AttentionConfigError(
            f"bad compute capability {short_repr(sm)}; accepted: e.g. cuda:80, cuda:90, cuda:100, cuda:120 or cuda:8.6"
        )
    return major, minor


@lru_cache(maxsize=None)
def _installed_version(module: str) -> str | None:
    """The installed distribution version of import name ``module`` (``+git.<sha>`` appended for a
    VCS install), or None."""
    import json
    from importlib import metadata

    top = module.split(".")[0]
    dists = metadata.packages_distributions().get(top) or [top]
    for dist in dists:
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        ver = d.version
        try:
            vcs = json.loads(d.read_text("direct_url.json") or "{}").get("vcs_info")
        except (ValueError, AttributeError):
            vcs = None
        if vcs and vcs.get("commit_id"):
            ver += f"+git.{vcs['commit_id'][:12]}"
        return ver
    return None


def detect_platform(device: "str | None" = None) -> Platform:
    """Detect the platform of ``device`` (default: the best accelerator the running PyTorch sees)."""
    import torch

    dev = torch.device(device) if device is not None else None
    kind = dev.type if dev is not None else None
    if kind in (None, "cuda") and torch.cuda.is_available():
        idx = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        name = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return Platform(name, "cuda", tuple(cap), torch.cuda.get_device_name(idx))
    if kind == "cuda":
        return Platform("cpu", "cpu")  # caller asked for CUDA without one; the device check reports it
    for plat in ("xpu", "musa", "npu"):
        mod = getattr(torch, plat, None)
        if kind in (None, plat) and mod is not None and getattr(mod, "is_available", lambda: False)():
            return Platform(plat, plat)
    if kind in (None, "mps") and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return Platform("mps", "mps")
    return Platform("cpu", "cpu")


_override: list[Platform] = []


@lru_cache(maxsize=None)
def _detected() -> Platform:
    return detect_platform()


def current_platform() -> Platform:
    """The platform in force: a ``use_platform`` override, else the detected one."""
    return _override[-1] if _override else _detected()


def platform_for_device(device) -> Platform:
    """The platform for tensors on ``device`` (a CPU tensor on a CUDA machine runs on the CPU)."""
    import torch

    dev = torch.device(device)
    cur = current_platform()
    if dev.type == cur.device_type or cur.simulated:
        return cur
    return Platform("cpu", "cpu") if dev.type == "cpu" else detect_platform(str(dev))


@contextlib.contextmanager
def use_platform(platform: Platform) -> Iterator[Platform]:
    """Run a block as if on ``platform`` (tests; ``plan --platform`` dry runs)."""
    _override.append(platform)
    try:
        yield platform
    finally:
        _override.pop()
