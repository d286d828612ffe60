"""One error base: every exception class that bundle/ and the engine define derives from
XmcserveError (defined in bundle/, the lowest layer, and offered by engine) and still from
the builtin base callers catch it by."""

import importlib
import inspect
import pkgutil

import bundle
import engine
from engine import AppendRefused, BundleError, XmcserveError


def modules_of(package) -> list:
    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.walk_packages(package.__path__)]


def defined_exceptions() -> list[type]:
    return [
        cls
        for module in modules_of(bundle) + modules_of(engine)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module.__name__
    ]


def test_every_exception_of_the_bundle_and_the_engine_is_an_xmcserve_error():
    found = defined_exceptions()
    assert len(found) >= 14
    assert [cls.__name__ for cls in found if not issubclass(cls, XmcserveError)] == []


def test_the_builtin_bases_are_kept():
    assert issubclass(AppendRefused, ValueError) and issubclass(BundleError, RuntimeError)
    assert all(
        issubclass(cls, (ValueError, RuntimeError, LookupError))
        for cls in defined_exceptions()
        if cls is not XmcserveError
    )
