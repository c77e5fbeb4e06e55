"""The proxy's bound on memory for request bodies, all connections together: raw bytes and what they parse into."""
from __future__ import annotations

from dataclasses import dataclass

from proxy.errors import ProxyError

MB = 1024 * 1024
PARSED_BYTES_PER_ITEM = 128
"""Upper bound of the memory json.loads spends per array item or object member beyond its text (measured worst, a
one-member dict of short strings, is 85): an empty list is 56 bytes, a one-key dict 184, an item's pointer 8 more,
and each costs at least one ',', ':', '[' or '{' of text."""


@dataclass(frozen=True)
class ParseCost:
    """Memory for one body beyond its arrived parts, while json.loads runs and after it."""

    peak: int
    """The parts' joined copy, the text json.loads decodes it to and the objects it parses into."""
    kept: int
    """The parsed objects alone: what the request still holds once the raw body and the decoded text are freed."""


def parse_cost(raw: bytes) -> ParseCost:
    """What parsing `raw` costs in memory. Over-estimates, never under:

    - Python stores a string at 1, 2 or 4 bytes a character, the widest character setting the width. One emoji
      makes the decoded text 4 bytes a character, so any non-ASCII byte or \\u escape counts 4 per byte for the
      text and 4 for the strings parsed out of it; a plain ASCII body counts 1 and 1.
    - Every ',', ':', '[' and '{' (those inside strings too) counts PARSED_BYTES_PER_ITEM: a body of empty
      arrays takes 20 times its size once parsed, and would otherwise slip past a limit on raw bytes.
    """
    width = 1 if raw.isascii() and b"\\u" not in raw else 4
    items = raw.count(b",") + raw.count(b":") + raw.count(b"[") + raw.count(b"{")
    kept = width * len(raw) + PARSED_BYTES_PER_ITEM * items
    return ParseCost(peak=(1 + width) * len(raw) + kept, kept=kept)


class BodyBudget:
    """Bytes all requests in the proxy may hold at once, counted as their bodies arrive and are parsed.

    A request holds its parsed body's share until the proxy has finished answering it (a stream's last byte),
    since the parsed body lives that long; the raw body and the text decoded from it are given back once parsed.
    A request that would take the total past `limit_bytes` is refused with a 503 (retry later) or, when it alone
    needs more than the limit, a 413; both in its API's format. A request holding no more than `grace_bytes` is
    never refused, so ordinary calls (a few KB to a few hundred) are still served while large bodies contend for
    the rest: the total stays under `limit_bytes` plus `grace_bytes` per request in flight, beside the 64 KiB
    uvicorn buffers per connection.
    """

    def __init__(self, limit_bytes: int, grace_bytes: int = 256 * 1024, retry_after_s: float = 1.0) -> None:
        if limit_bytes <= 0 or grace_bytes < 0:
            raise ValueError(f"body budget needs limit_bytes > 0 and grace_bytes >= 0, got {limit_bytes}, "
                             f"{grace_bytes}")
        self.limit_bytes, self.grace_bytes, self.retry_after_s = limit_bytes, grace_bytes, retry_after_s
        self.in_use = 0
        self.refused = 0  # requests refused for want of room (503)

    def hold(self) -> BodyHold:
        return BodyHold(self)


class BodyHold:
    """What one request holds of the budget; `release` gives it all back when the request is done."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0

    def take(self, n: int) -> None:
        """Count `n` more bytes against the budget, or raise the ProxyError the request must be answered with."""
        budget, total = self.budget, self.held + n
        if total > budget.grace_bytes and budget.in_use + n > budget.limit_bytes:
            if total > budget.limit_bytes:
                raise ProxyError(413, f"request body needs about {-(-total // MB)} MB of proxy memory once parsed, "
                                      f"over the proxy's {budget.limit_bytes // MB} MB for all bodies together",
                                 "request_too_large")
            budget.refused += 1
            raise ProxyError(503, "proxy is holding too many large request bodies; retry shortly",
                             "proxy_overloaded", {"retry-after": str(max(1, round(budget.retry_after_s)))})
        budget.in_use += n
        self.held = total

    def give(self, n: int) -> None:
        """Give `n` bytes back early (what a request no longer holds)."""
        n = min(n, self.held)
        self.budget.in_use -= n
        self.held -= n

    def release(self) -> None:
        self.budget.in_use -= self.held
        self.held = 0
