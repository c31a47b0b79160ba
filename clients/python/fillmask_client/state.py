"""A connection's state, and the one function that changes it (the same shape as ``web_demo/client.js``).

::

    connecting --hello--> open --going_away--> draining
        \\______________\\_____________________\\___close__> closed

- ``connecting``: the WebSocket is open, its ``hello`` (§2) has not been read yet; nothing is sent.
- ``open``: the ``hello`` came and was acceptable; new requests may be sent here.
- ``draining``: the server said it takes no more work here: its ``going_away`` (§10), or an
  ``overloaded`` ``shutting_down``/``engine_stopped`` answer (§6), which is the same notice given in
  answer to a request. Nothing new is sent; the answers already owed still arrive and are delivered.
- ``closed``: final. Requests still in flight on it are lost (§8).

``transition`` is pure: an event that means nothing in a state (a second ``hello``, a notice while
draining, anything once closed) leaves the state as it is, so callers never need to check first.
"""

from __future__ import annotations

import enum


class ConnState(enum.Enum):
    """Where one connection is in its life; see the module docstring."""

    CONNECTING = "connecting"
    OPEN = "open"
    DRAINING = "draining"
    CLOSED = "closed"


class Event(enum.Enum):
    """What can happen to a connection."""

    HELLO = "hello"  # an acceptable hello frame was read
    GOING_AWAY = "going_away"  # the server takes no more work here (going_away, or such an answer)
    CLOSE = "close"  # the connection ended, whoever closed it and however


TRANSITIONS: dict[ConnState, dict[Event, ConnState]] = {
    ConnState.CONNECTING: {Event.HELLO: ConnState.OPEN, Event.GOING_AWAY: ConnState.DRAINING,
                           Event.CLOSE: ConnState.CLOSED},
    ConnState.OPEN: {Event.GOING_AWAY: ConnState.DRAINING, Event.CLOSE: ConnState.CLOSED},
    ConnState.DRAINING: {Event.CLOSE: ConnState.CLOSED},
    ConnState.CLOSED: {},
}


def transition(state: ConnState, event: Event) -> ConnState:
    """The state after ``event``: the one place a connection's state changes (see ``TRANSITIONS``)."""
    return TRANSITIONS[state].get(event, state)
