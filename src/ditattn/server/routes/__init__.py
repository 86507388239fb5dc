"""The HTTP endpoints, one FastAPI router per resource: :mod:`.images`, :mod:`.videos`,
:mod:`.models`, :mod:`.health` (``/health`` and ``/metrics``)."""
