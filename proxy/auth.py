"""Rollout secrets: hashing, extracting the presented key, and constant-time comparison."""
from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request


def hash_secret(secret: str) -> str:
    """sha256 hex of a rollout secret; the web app stores secrets hashed with this same function."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def presented_keys(request: Request) -> list[str]:
    """The API keys sent as `Authorization: Bearer <key>` and/or `x-api-key` (Anthropic clients may send both)."""
    keys = []
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if request.headers.get("x-api-key", "").strip():
        keys.append(request.headers["x-api-key"].strip())
    return keys


def key_matches(key: str | None, secret_hash: str) -> bool:
    if not key:
        return False
    return hmac.compare_digest(hash_secret(key), secret_hash)


def any_key_matches(keys: list[str], secret_hash: str) -> bool:
    return any([key_matches(key, secret_hash) for key in keys])  # a list: compare every key, in constant time
