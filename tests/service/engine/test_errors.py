"""service.engine.errors: every exception class the engine defines derives from EngineError and
still from the builtin base callers catch it by."""

import inspect

import service.engine.append_log
import service.engine.batcher
import service.engine.bundle
import service.engine.hnsw_file
import service.engine.ivfpq
import service.engine.labels
import service.engine.mapped_files
import service.engine.memory
from service.engine import AppendRefused, BundleError, EngineError

MODULES = (
    service.engine.append_log,
    service.engine.batcher,
    service.engine.bundle,
    service.engine.hnsw_file,
    service.engine.ivfpq,
    service.engine.labels,
    service.engine.mapped_files,
    service.engine.memory,
)


def engine_exceptions() -> list[type]:
    return [
        cls
        for module in MODULES
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module.__name__
    ]


def test_every_engine_exception_is_an_engine_error():
    found = engine_exceptions()
    assert len(found) >= 14
    assert [cls.__name__ for cls in found if not issubclass(cls, EngineError)] == []


def test_the_builtin_bases_are_kept():
    assert issubclass(AppendRefused, ValueError) and issubclass(BundleError, RuntimeError)
    assert all(issubclass(cls, (ValueError, RuntimeError)) for cls in engine_exceptions())
