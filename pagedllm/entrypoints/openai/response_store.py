"""The Responses API's stored responses: what ``GET /v1/responses/{id}`` returns and ``previous_response_id``
continues, kept in memory and bounded.

Three bounds keep it from growing without limit:

* the number of responses: at most ``capacity`` (``--max-stored-responses``); storing one more evicts the
  least recently used (stored, read by GET, or continued by a later request);
* their size: at most ``max_bytes`` (``--max-stored-response-bytes``) in all, each response counted as its JSON
  and its conversation's (clients choose fields such as ``user`` and ``tools``: 1,000 responses of 4 MB bodies
  held 4.3 GB); past it the least recently used go, and a response larger than the whole budget is not stored;
* what one response holds: its conversation, which was a prompt that fit the context window (a chain that
  outgrows it is refused with the too-long-prompt 400 and not stored), plus its own output.

Only the event loop touches it (the route handlers), so it needs no lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.entrypoints.openai import protocol as P
from pagedllm.errors import InvalidParameterError

logger = logging.getLogger("pagedllm")


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: P.ResponsesResponse
    """The response object, as the request that made it was answered."""
    messages: tuple[P.ChatMessage, ...]
    """The conversation through this response (its input, then its output), as chat messages, without its
    ``instructions`` (OpenAI does not carry them on to the next response)."""


class ResponseStore:
    """Response id → :class:`StoredResponse`, least recently used first.

    Invariants: ``len(self) <= capacity``; ``bytes`` is the sum of the stored responses' sizes, ``<= max_bytes``.
    """

    def __init__(self, capacity: int, max_bytes: int = 256 << 20):
        for name, value in (("max_stored_responses", capacity), ("max_stored_response_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}", name)
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> bool:
        """Store it (evicting the least recently used past either bound); False if it alone is over max_bytes."""
        rid = stored.response.id
        size = len(stored.response.model_dump_json()) + sum(len(m.model_dump_json()) for m in stored.messages)
        self.delete(rid)
        if size > self.max_bytes:
            logger.warning(
                "response %s is not stored: its %d bytes exceed --max-stored-response-bytes (%d)",
                rid,
                size,
                self.max_bytes,
            )
            return False
        self._items[rid], self._sizes[rid] = stored, size
        self.bytes += size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            self.delete(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None: never stored, deleted or evicted."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        if self._items.pop(response_id, None) is None:
            return False
        self.bytes -= self._sizes.pop(response_id)
        return True

    def check_invariants(self) -> None:
        assert len(self._items) <= self.capacity
        assert self._sizes.keys() == self._items.keys() and self.bytes == sum(self._sizes.values()) <= self.max_bytes
        assert all(key == stored.response.id for key, stored in self._items.items())
