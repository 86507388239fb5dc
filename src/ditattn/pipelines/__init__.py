"""Pipelines: ``model_index.json`` loading (:mod:`.model_index`), component construction under
attention overrides (:mod:`.loading`), the denoise loop (:mod:`.wan`), the diffusers passthrough
(:mod:`.diffusers_backend`) and writing outputs (:mod:`.output`).  The commands that drive them
live in :mod:`ditattn.entrypoints`."""
