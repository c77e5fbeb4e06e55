"""Rollout secrets: hashing, extracting the presented key, and constant-time comparison."""
from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request


def hash_secret(secret: str) -> str:
    """sha256 hex of a rollout secret; the web app stores secrets hashed with this same function."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def presented_key(request: Request) -> str | None:
    """The API key from `Authorization: Bearer <key>` or `x-api-key`, whichever is present."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = request.headers.get("x-api-key", "").strip()
    return key or None


def key_matches(key: str | None, secret_hash: str) -> bool:
    if not key:
        return False
    return hmac.compare_digest(hash_secret(key), secret_hash)
