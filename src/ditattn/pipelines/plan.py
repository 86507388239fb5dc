"""The attention plan of the native pipeline: its JSON object (:func:`build_plan`),
the DiT backends it names (:func:`dit_backends`) and its human-readable rendering
(:func:`format_plan`)."""

from __future__ import annotations

from typing import Mapping, Optional

from ditattn.attention.names import ROLES
from ditattn.pipelines.loading import DIT

COMPONENT_ORDER = ("text_encoder", "image_encoder", "transformer", "transformer_2", "vae")


def build_plan(platform, scopes: Mapping, quantization: Mapping) -> dict:
    """``{"platform": {...}, "components": [{"name", "selectable", "layers": [{"prefix", "role",
    "backend", "source", "fallback_reason"}], "linear_quantization"?}]}`` of a pipeline's component
    ``scopes`` (name -> :class:`~ditattn.attention.context.ComponentScope`; pipeline order first) on
    ``platform``; ``quantization``: ``{DiT component: QuantizationPlan}`` (``--dit-quantization``,
    listed unless its mode is none)."""
    order = [c for c in COMPONENT_ORDER if c in scopes]
    order += [c for c in scopes if c not in order]
    comps = []
    for c in order:
        entry = {"name": c, "selectable": scopes[c].selectable, "layers": [d.to_json() for d in scopes[c].decisions]}
        if c in quantization and quantization[c].mode != "none":  # --dit-quantization: the rule's result
            entry["linear_quantization"] = {**quantization[c].to_json(), "summary": quantization[c].describe()}
        comps.append(entry)
    return {"platform": platform.to_json(), "components": comps}


def dit_backends(scopes: Mapping) -> list[str]:
    """The backends the DiT layers of ``scopes`` were built with (self-attention first; a per-call
    fallback once a call has used it), without duplicates."""
    out: list[str] = []
    for c in DIT:
        if c in scopes:
            for role in ROLES:
                for d in scopes[c].decisions:
                    out += [b.value for b in d.ran_backends() if d.role == role and b.value not in out]
    return out


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start, prev = [], None, None
    for i in sorted(idx):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


def _layer_index(prefix: str) -> Optional[int]:
    for part in prefix.split("."):
        if part.isdigit():
            return int(part)
    return None


def compact_names(names: list[str]) -> str:
    """Module names with their block index folded: ``blocks.0.ffn``, ``blocks.1.ffn`` ->
    ``blocks.{0-1}.ffn``."""
    groups: dict[str, list[int]] = {}
    for name in names:
        parts = name.split(".")
        i = next((j for j, p in enumerate(parts) if p.isdigit() and j and parts[j - 1] == "blocks"), None)
        if i is None:
            groups.setdefault(name, [])
        else:
            groups.setdefault(".".join(parts[:i] + ["{}"] + parts[i + 1 :]), []).append(int(parts[i]))
    return ", ".join(t.replace("{}", "{" + _ranges(idx) + "}") if idx else t for t, idx in groups.items())


def _quantization_lines(comp: dict) -> list[str]:
    """``--dit-quantization``: the rule's result for one DiT component (counts, and what stays)."""
    lq = comp.get("linear_quantization")
    if not lq:
        return []
    done = ", ".join(f"{g['count']} {g['reason']}" for g in lq["groups"] if g["quantized"])
    lines = [
        f"{comp['name']} linears: {lq['mode']}, {lq['quantized']} of {lq['total']} quantized"
        + (f" ({done})" if done else "")
    ]
    lines += [f"  kept {compact_names(g['layers'])}: {g['reason']}" for g in lq["groups"] if not g["quantized"]]
    if lq.get("activations"):  # fp8: the fused activation quantizer, torchao's path where it does not apply
        lines.append(f"  activations: {lq['activations']['summary']}")
    return lines


def format_plan(plan: dict, *, model: str = "", dtype: str = "", override: Optional[str] = None) -> str:
    """The plan as a table: one row per (component, role, backend, source, fallback reason) with the
    layer indices it covers; fixed-attention components are listed as such."""
    plat = plan["platform"]
    cap = f" (capability {plat['capability'][0]}.{plat['capability'][1]})" if plat.get("capability") else ""
    sim = f" [simulated, packages: {', '.join(plat.get('packages') or ()) or 'none'}]" if plat.get("simulated") else ""
    lines = [f"platform: {plat['name']}{cap}, device {plat['device']}" + (f", dtype {dtype}" if dtype else "") + sim]
    if model:
        lines.append(f"model: {model}")
    rows = []
    notes = []
    for comp in plan["components"]:
        if not comp["selectable"]:
            rows.append((comp["name"], "-", "-", "fixed", "-", "fixed attention (overrides rejected)"))
            continue
        if not comp["layers"]:
            rows.append((comp["name"], "-", "-", "-", "-", "no attention layers"))
            continue
        groups: dict[tuple, list] = {}
        for layer in comp["layers"]:
            key = (
                layer["role"],
                layer["backend"],
                layer["source"],
                layer.get("fallback_reason"),
                layer.get("runtime_fallback"),
            )
            groups.setdefault(key, []).append(layer["prefix"])
        for (role, backend, source, reason, per_call), prefixes in groups.items():
            idx = [i for i in (_layer_index(p) for p in prefixes) if i is not None]
            where = f"{len(prefixes)} ({_ranges(idx)})" if idx else str(len(prefixes))
            note = ""
            if reason:
                notes.append(reason)
                note = f"fallback [{len(notes)}]"
            if per_call:
                note = (note + "; " if note else "") + f"calls {backend} has no kernel for run {per_call}"
            rows.append((comp["name"], role, where, backend, source, note))
    head = ("component", "role", "layers", "backend", "source", "note")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head).rstrip())
    lines.extend(fmt.format(*map(str, r)).rstrip() for r in rows)
    for i, n in enumerate(notes, 1):
        lines.append(f"[{i}] {n}")
    for comp in plan["components"]:
        lines.extend(_quantization_lines(comp))
    if override:
        lines.append(f"request override: DiT attention runs {override} for this run (validated)")
    return "\n".join(lines)
