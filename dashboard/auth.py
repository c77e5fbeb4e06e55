"""Websocket authentication: the session cookie, or an API token in the `token` query parameter."""
from __future__ import annotations

from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware


@database_sync_to_async
def _user_for_token(key: str):
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    return token.user if token and token.user.is_active else None


class TokenAuthMiddleware(BaseMiddleware):
    """Replaces an anonymous session user with the token's user when `?token=` is given."""

    async def __call__(self, scope, receive, send):
        query = parse_qs(scope.get("query_string", b"").decode())
        key = (query.get("token") or [""])[0]
        user = scope.get("user")
        if key and (user is None or not user.is_authenticated):
            token_user = await _user_for_token(key)
            if token_user is not None:
                scope = dict(scope, user=token_user)
        return await super().__call__(scope, receive, send)


def TokenAuthMiddlewareStack(inner):  # noqa: N802 (mirrors channels' AuthMiddlewareStack)
    return AuthMiddlewareStack(TokenAuthMiddleware(inner))
