"""Every backend is declared in one module: its capability row, its parameter schema and its
implementation, or a row that says why this build has no implementation."""

import importlib
import pkgutil

import pytest

import ditattn.attention.backends as backends_pkg
from ditattn.attention import specs
from ditattn.attention.backends.base import get_impl, has_impl
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import SCHEMAS, schema_for
from ditattn.attention.specs import SPECS


@pytest.mark.parametrize("backend", list(B), ids=lambda b: b.value)
def test_every_backend_has_a_row_and_an_implementation_or_a_reason(backend):
    spec = SPECS[backend]
    assert spec.backend is backend
    assert spec.kind and spec.summary
    if has_impl(backend):
        assert callable(get_impl(backend))
        assert not spec.missing_kernel, f"{backend.value} is implemented but its row says it is missing"
    else:
        assert spec.missing_kernel.strip(), f"{backend.value}: no implementation and no reason why"
        with pytest.raises(LookupError, match=backend.value):
            get_impl(backend)
    if spec.config_schema is not None:
        assert spec.config_schema in SCHEMAS and schema_for(backend) == SCHEMAS[spec.config_schema]


def test_every_schema_belongs_to_a_backend():
    used = {SPECS[b].config_schema for b in B}
    assert set(SCHEMAS) <= used


def test_the_module_map_is_the_package():
    """Each module of ``ditattn.attention.backends`` is imported by the package, and every backend's
    implementation lives in one of them (no hand-kept map to forget)."""
    names = {m.name for m in pkgutil.iter_modules(backends_pkg.__path__)} - {"base"}
    for name in names:
        assert getattr(backends_pkg, name, None) is importlib.import_module(f"{backends_pkg.__name__}.{name}"), name
    for b in B:
        if has_impl(b):
            assert get_impl(b).__module__.rpartition(".")[2] in names


def test_a_missing_declaration_is_named(monkeypatch):
    monkeypatch.delitem(specs.TABLE, B.VMOBA_ATTN)
    with pytest.raises(AssertionError, match="vmoba_attn"):
        specs.load_backends()


def test_a_backend_is_declared_once():
    from ditattn.attention.backends.base import declare

    with pytest.raises(ValueError, match="declared twice"):
        declare(B.TORCH_SDPA, spec=SPECS[B.TORCH_SDPA])
