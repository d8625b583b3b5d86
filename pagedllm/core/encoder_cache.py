"""The scheduler's record of the model runner's encoder cache (vision-language models).

The runner keeps each encoded image's output (its rows for the image's placeholder tokens) by image hash, so a
prompt prefilled in chunks, a preempted request computed again or an n > 1 sibling reads it instead of encoding
the image again. This record decides what the runner holds: the scheduler grants an image's encoding in a step
(``add``) only where the cache has room for it, a request reading an image holds it (``read``) until its
computed tokens have passed the image's placeholders, and an image nobody reads stays cached until room is
needed (the oldest first); the runner drops what :meth:`take_freed` returns before it encodes the next step's
images. Sizes are in tokens (an encoder output's rows).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class EncoderStats:
    """Encoder work since the last stats call."""

    queries: int = 0  # images a request reached: looked up in the encoder cache
    hits: int = 0  # of which found there (encoded before, for this request or another)
    images: int = 0  # images encoded
    tokens: int = 0  # their tokens (encoder output rows)

    def take(self) -> EncoderStats:
        out = EncoderStats(self.queries, self.hits, self.images, self.tokens)
        self.queries = self.hits = self.images = self.tokens = 0
        return out


class EncoderCacheManager:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.sizes: dict[str, int] = {}  # cached image hash -> its tokens
        self.readers: dict[str, set[str]] = {}  # cached image hash -> the requests that still read it
        self.unread: OrderedDict[str, None] = OrderedDict()  # cached and read by nobody, oldest first
        self.used = 0  # tokens cached
        self.unread_tokens = 0  # of which unread (room that evicting gives back)
        self._freed: list[str] = []
        self.num_encoded = 0  # images granted an encoding, ever
        self.stats = EncoderStats()  # since the last SchedulerStats

    def has(self, identifier: str) -> bool:
        return identifier in self.sizes

    def fits(self, num_tokens: int) -> bool:
        """Room for an image of ``num_tokens`` once every unread image is evicted."""
        return self.used - self.unread_tokens + num_tokens <= self.capacity

    def is_unread(self, identifier: str) -> bool:
        return identifier in self.unread

    def pinned_size(self, identifiers: set[str]) -> int:
        """Tokens of these cached images (each unread now, and about to be read)."""
        return sum(self.sizes[h] for h in identifiers)

    def add(self, identifier: str, num_tokens: int, req_id: str) -> None:
        """Record an image the runner encodes this step, read by ``req_id``; evicts unread images for room."""
        assert identifier not in self.sizes and self.fits(num_tokens), "add only what fits and is not cached"
        while self.used + num_tokens > self.capacity:
            old, _ = self.unread.popitem(last=False)
            size = self.sizes.pop(old)
            del self.readers[old]
            self.used -= size
            self.unread_tokens -= size
            self._freed.append(old)
        self.sizes[identifier] = num_tokens
        self.readers[identifier] = {req_id}
        self.used += num_tokens
        self.num_encoded += 1
        self.stats.queries += 1
        self.stats.images += 1
        self.stats.tokens += num_tokens

    def read(self, identifier: str, req_id: str) -> None:
        """``req_id`` reads a cached image this step: it stays cached while the request needs it."""
        if identifier in self.unread:
            del self.unread[identifier]
            self.unread_tokens -= self.sizes[identifier]
        readers = self.readers[identifier]
        if req_id not in readers:  # a lookup per image a request reaches (not per chunk that reads it)
            self.stats.queries += 1
            self.stats.hits += 1
        readers.add(req_id)

    def release(self, identifier: str, req_id: str) -> None:
        readers = self.readers.get(identifier)
        if readers is None or req_id not in readers:
            return
        readers.discard(req_id)
        if not readers:
            self.unread[identifier] = None
            self.unread_tokens += self.sizes[identifier]

    def take_freed(self) -> list[str]:
        """The images evicted since the last call: the runner drops their outputs."""
        out, self._freed = self._freed, []
        return out

    def check_invariants(self, live_requests: set[str]) -> None:
        assert self.used == sum(self.sizes.values()) <= self.capacity
        assert self.unread_tokens == sum(self.sizes[h] for h in self.unread)
        for h, readers in self.readers.items():
            assert (not readers) == (h in self.unread), h
            assert readers <= live_requests, f"{h} is read by finished requests {readers - live_requests}"
