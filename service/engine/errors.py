"""The engine's one error base: every exception the engine raises on purpose is an
:class:`EngineError`, so a front end can catch the engine's refusals apart from its own bugs.

Each subclass keeps the builtin base callers already catch it by (``ValueError`` for a refused
input or file, ``RuntimeError`` for a state the engine cannot go on from), so an ``except
ValueError`` that caught one still does."""


class EngineError(Exception):
    """Base of the engine's exceptions (:mod:`service.engine`)."""
