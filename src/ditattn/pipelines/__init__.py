"""Pipelines: ``model_index.json`` loading, component construction under attention overrides, the
denoise loop (:mod:`.wan`), the diffusers passthrough, and the ``generate`` / ``plan`` commands
(:mod:`.run`)."""
