"""Request bodies as strict JSON: what json.loads accepts, less what would fail later as a 500 or a lost record."""
from __future__ import annotations

import json
import math
import re

from proxy.errors import ProxyError

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a request may have. Real tool schemas nest under 20 levels; near
Python's recursion limit (about 950 here) encoding the engine request or the record fails instead."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A \\uD800-\\uDFFF escape in raw JSON: only then can the parsed body hold a lone surrogate."""


def parse_json(raw: bytes, finite: bool = True) -> object:
    """The body parsed as strict JSON, or a 400 naming what is wrong.

    Refused beyond json's grammar, because each would fail later, as a 500 or a lost record: NaN and
    infinities (not JSON; the engine and PostgreSQL reject them), lone UTF-16 surrogates (no UTF-8 encoding,
    so neither the engine request nor the record can be written) and nesting past Python's recursion limit.
    """
    too_deep = ProxyError(400, f"request body is nested too deeply (over {MAX_JSON_DEPTH} levels)", "invalid_json")
    try:
        # What json.loads does with bytes, with a decoder made once (json.loads makes one per call given options).
        body = (_STRICT if finite else _LAX).decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except RecursionError:
        raise too_deep from None
    except ValueError:
        raise ProxyError(400, "request body is not valid JSON", "invalid_json") from None
    if _nests_deeper(raw, body, MAX_JSON_DEPTH):
        raise too_deep
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ProxyError(400, "request body holds a lone UTF-16 surrogate (invalid Unicode)",
                             "invalid_json") from None
    return body


def _nests_deeper(raw: bytes, body: object, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep (bracket count first: most bodies skip the walk)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack = [(body, 1)] if isinstance(body, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _not_json(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


_STRICT = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite_float)
_LAX = json.JSONDecoder()
