"""One Redis address for the three things that use it, plain or through Redis Sentinel.

REDIS_URL (and CELERY_BROKER_URL) is either a plain `redis://` / `rediss://` URL or the Sentinel form kombu reads:

    sentinel://[:PASSWORD@]HOST:PORT[/DB][;sentinel://HOST:PORT...]

one entry per sentinel, the password (the primary's) and the database on the first. The group's name is
LIGHTNING_REDIS_SENTINEL_MASTER; sentinels that need a password of their own get LIGHTNING_REDIS_SENTINEL_PASSWORD.
From that this module builds what each user of Redis takes: Celery's broker URL and transport options (kombu's
Sentinel transport), the channel layer's host entry (channels-redis's `sentinels`/`master_name` form) and a plain
redis-py client for the pool workers' device-set claims (redis-py's Sentinel `master_for`). Each asks the sentinels
for the current primary on every new connection, so a failover is followed without a restart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

SCHEMES = ("redis", "rediss", "sentinel")


@dataclass(frozen=True)
class Sentinels:
    hosts: tuple[tuple[str, int], ...]
    password: str | None
    username: str | None
    db: int


def is_sentinel(url: str) -> bool:
    return url.startswith("sentinel://")


def parse_sentinel(url: str) -> Sentinels:
    """The sentinels, password and database of a `sentinel://` URL; ValueError saying what is wrong otherwise."""
    hosts, password, username, db = [], None, None, 0
    for index, part in enumerate(p for p in url.split(";") if p.strip()):
        parsed = urlsplit(part.strip())
        if parsed.scheme != "sentinel":
            raise ValueError(f"every entry must start with sentinel://, not {part.split('://')[0]}://")
        try:
            port = parsed.port or 26379
        except ValueError:
            raise ValueError("a sentinel's port must be a number from 1 to 65535") from None
        if not parsed.hostname:
            raise ValueError("each sentinel entry needs a host, e.g. sentinel://10.0.0.1:26379")
        hosts.append((parsed.hostname, port))
        if index == 0:
            password = unquote(parsed.password) if parsed.password else None
            username = unquote(parsed.username) if parsed.username else None
            path = parsed.path.strip("/")
            if path and not path.isdigit():
                raise ValueError(f"the database must be a number, not {path!r}")
            db = int(path or 0)
    if not hosts:
        raise ValueError("no sentinel given")
    return Sentinels(tuple(hosts), password, username, db)


def _sentinel_kwargs(password: str | None) -> dict[str, Any] | None:
    return {"password": password} if password else None


def broker_transport_options(url: str, master: str, sentinel_password: str | None) -> dict[str, Any]:
    """Celery's broker_transport_options for `url`: the Sentinel group (and the sentinels' password) or nothing."""
    if not is_sentinel(url):
        return {}
    options: dict[str, Any] = {"master_name": master}
    if sentinel_password:
        options["sentinel_kwargs"] = _sentinel_kwargs(sentinel_password)
    return options


def channel_layer_host(url: str, master: str, sentinel_password: str | None) -> str | dict[str, Any]:
    """The channels-redis `hosts` entry for `url`: the URL itself, or the Sentinel form of channels_redis.utils."""
    if not is_sentinel(url):
        return url
    spec = parse_sentinel(url)
    host: dict[str, Any] = {"sentinels": list(spec.hosts), "master_name": master, "db": spec.db}
    if spec.password:
        host["password"] = spec.password
    if spec.username:
        host["username"] = spec.username
    if sentinel_password:
        host["sentinel_kwargs"] = _sentinel_kwargs(sentinel_password)
    return host


def client(url: str, master: str, sentinel_password: str | None, **kwargs):
    """A redis-py client of the primary `url` names (through its sentinels for a Sentinel URL)."""
    import redis
    from redis.sentinel import Sentinel

    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    spec = parse_sentinel(url)
    sentinels = Sentinel(list(spec.hosts), sentinel_kwargs=_sentinel_kwargs(sentinel_password),
                         socket_timeout=kwargs.get("socket_timeout", 5))
    return sentinels.master_for(master, db=spec.db, password=spec.password, username=spec.username, **kwargs)
