"""A client that goes away while its request waits for its batch: the server's own signal.

Under ASGI an app learns that its client left only from a ``receive()`` that returns
``http.disconnect``, so a handler that waits for something else needs a second task to wait on
``receive()`` beside it (:func:`service.http.app.answer_unless_gone`): a task made, stepped and
cancelled per request, on the event loop. :class:`~service.http.server.GuardedProtocol` instead
gives each request's scope a :class:`ClientGone` of its connection under
``scope["extensions"][EXTENSION]``: the handler registers a callback, and the protocol calls it
(on the loop) when the connection is lost. Under a server without it (a test client, another
ASGI server) the handler falls back to the watcher task.
"""

from __future__ import annotations

from collections.abc import Callable

EXTENSION = "xmcserve.client_gone"


class ClientGone:
    """One connection's callbacks to call when it is lost (each at most once)."""

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self._callbacks: set[Callable[[], None]] = set()
        self.gone = False

    def add(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the connection is lost; at once if it already was."""
        if self.gone:
            callback()
        else:
            self._callbacks.add(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def lost(self) -> None:
        """The connection was lost: every registered callback, once (called by the protocol)."""
        self.gone = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()
