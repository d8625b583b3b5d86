"""The Responses API's stored responses: what ``GET /v1/responses/{id}`` returns and ``previous_response_id``
continues, kept in memory and bounded.

Two bounds keep it from growing without limit:

* the number of responses: at most ``capacity`` (``--max-stored-responses``); storing one more evicts the
  least recently used (stored, read by GET, or continued by a later request);
* what one response holds: its conversation, which was a prompt that fit the context window (a chain that
  outgrows it is refused with the too-long-prompt 400 and not stored), plus its own output.

Only the event loop touches it (the route handlers), so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.entrypoints.openai import protocol as P
from pagedllm.errors import InvalidParameterError


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: P.ResponsesResponse
    """The response object, as the request that made it was answered."""
    messages: tuple[P.ChatMessage, ...]
    """The conversation through this response (its input, then its output), as chat messages, without its
    ``instructions`` (OpenAI does not carry them on to the next response)."""


class ResponseStore:
    """Response id → :class:`StoredResponse`, least recently used first.

    Invariant: ``len(self) <= capacity``.
    """

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidParameterError(
                f"max_stored_responses must be an integer >= 1, got {capacity!r}", "max_stored_responses"
            )
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None: never stored, deleted or evicted."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def check_invariants(self) -> None:
        assert len(self._items) <= self.capacity
        assert all(key == stored.response.id for key, stored in self._items.items())
