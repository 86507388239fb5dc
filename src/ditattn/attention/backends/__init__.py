"""The attention backends, one module per family; importing this package imports every one of them,
so each declares its capability row, parameter schema and implementation (``base.register`` /
``base.declare``).  A new backend: a member of ``names.AttentionBackendEnum`` and a module here,
imported below (docs/attention.md, "Adding a backend")."""

from ditattn.attention.backends import (  # noqa: F401  (imported for their declarations)
    flash,
    sage,
    sage3,
    sage_crossover,
    sdpa,
    sla,
    sliding_tile,
    sol,
    sparge,
    sparse_common,
    svg2,
    unavailable,
    video_sparse,
    vmoba,
)
