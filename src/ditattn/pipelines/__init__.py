"""Pipelines: ``model_index.json`` loading (:mod:`.model_index`), component construction under
attention overrides (:mod:`.loading`), the native Wan pipeline (:mod:`.wan`) with its stages —
prompts (:mod:`.text`), image conditioning (:mod:`.conditioning`), latents and size rules
(:mod:`.latents`), the denoise loop (:mod:`.denoise`), one call's inputs, scope and result
(:mod:`.generation`) — the diffusers passthrough (:mod:`.diffusers_backend`) and writing outputs
(:mod:`.output`).  The commands that drive them live in :mod:`ditattn.entrypoints`."""
