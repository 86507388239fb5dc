"""ditattn inside other libraries' pipelines: :mod:`.diffusers` (``apply(pipe, ...)`` /
``remove(pipe)`` on an existing diffusers pipeline)."""
