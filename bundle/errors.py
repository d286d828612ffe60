"""The errors of the bundle contract, and the one base of every error xmcserve's libraries raise
on purpose.

:class:`XmcserveError` is defined here, in the lowest layer, so the bundle's refusals and the
engine's (a refused append, a full queue) share it: a front end catches them apart from its own
bugs. Each subclass keeps the builtin base callers already catch it by (``ValueError`` for a
refused input or file, ``RuntimeError`` for a state that cannot go on), so an ``except
ValueError`` that caught one still does. Whichever check of whichever file refuses a bundle,
the caller gets a :class:`BundleError` naming the file and the reason.
"""


class XmcserveError(Exception):
    """Base of the exceptions of :mod:`bundle` and :mod:`engine`."""


class BundleError(XmcserveError, RuntimeError):
    """The bundle is missing, corrupt or inconsistent; the message says which part."""
