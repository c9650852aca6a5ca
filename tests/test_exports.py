"""The public API is what ``kvrouter.__all__`` says: every name listed once, sorted, importable, and
every public name of a component package re-exported where it belongs."""

from __future__ import annotations

import importlib
import pickle
import types

import pytest

import kvrouter

COMPONENT_PACKAGES = (
    "kvrouter.client",
    "kvrouter.events",
    "kvrouter.events.codecs",
    "kvrouter.hashing",
    "kvrouter.index",
    "kvrouter.routing",
    "kvrouter.sim",
    "kvrouter.worker",
)


def _isort_order(names: list[str]) -> list[str]:
    """Ruff's ``__all__`` order (RUF022): CONSTANTS, then Classes, then functions, each alphabetical."""
    return sorted(names, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))


def test_all_is_sorted_and_unique():
    assert kvrouter.__all__ == _isort_order(list(set(kvrouter.__all__)))


def test_every_exported_name_exists():
    for name in kvrouter.__all__:
        assert hasattr(kvrouter, name), name


def test_no_public_name_is_left_out():
    """Every public object of the package is listed; submodules are attributes only once imported."""
    public = {
        name
        for name, obj in vars(kvrouter).items()
        if not name.startswith("_") and not isinstance(obj, types.ModuleType) and name != "annotations"
    }
    assert public == set(kvrouter.__all__)


@pytest.mark.parametrize("package", COMPONENT_PACKAGES)
def test_component_all_is_sorted_unique_and_present(package: str):
    module = importlib.import_module(package)
    names = module.__all__
    assert names == _isort_order(list(set(names)))
    for name in names:
        assert hasattr(module, name), f"{package}.{name}"


def test_exported_classes_present_the_public_path():
    assert kvrouter.Stored.__module__ == "kvrouter"
    assert repr(kvrouter.StorageTier.HOST) == "<StorageTier.HOST: 'host'>"
    event = kvrouter.Stored(1, None, (kvrouter.StoredBlock(kvrouter.EngineHash(1), kvrouter.LocalHash(2)),))
    assert pickle.loads(pickle.dumps(event)) == event
