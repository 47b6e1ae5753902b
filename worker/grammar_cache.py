"""Compiled structured-output grammars kept for reuse, keyed by the guide's JSON text
(`SamplingParams.guide`), least recently used first out once their sizes pass a byte budget.

Clients send the same few schemas again and again: a hit skips rebuilding the schema's grammar text and
xgrammar's compilation, and lets the worker's intake start the request at once rather than hand it to its
compile threads (`worker.service_compiles`). Its one lock makes it safe from those threads and the step
thread alike; xgrammar's own compiler cache is off, so this is the one place compiled grammars are kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class GrammarCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # guide → (grammar, bytes)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, guide: str) -> Any | None:
        """The compiled grammar of `guide` (an `xgrammar.CompiledGrammar`), or None."""
        with self._lock:
            entry = self._entries.get(guide)
            if entry is None:
                return None
            self._entries.move_to_end(guide)
            return entry[0]

    def __contains__(self, guide: str) -> bool:
        with self._lock:
            return guide in self._entries

    def put(self, guide: str, grammar: Any, size: int) -> None:
        """Keep `grammar` (`size` bytes), evicting the least recently used until the budget holds; one
        larger than the whole budget is not kept."""
        with self._lock:
            old = self._entries.pop(guide, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[guide] = (grammar, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
