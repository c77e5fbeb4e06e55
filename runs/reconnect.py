"""Database calls of long-lived worker code that outlive a PostgreSQL restart: drop the broken connection, retry.

Django reconnects only at request boundaries (`close_old_connections`); a run's worker has none for hours, so one
restart of PostgreSQL would leave its thread's connection dead and every later query failing.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, TypeVar

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError, connection

from common.procs import name_os_thread

logger = logging.getLogger(__name__)

RETRY_FOR_S = 60.0
"""How long a call keeps trying while the database is unreachable (a restart takes a few seconds)."""
T = TypeVar("T")


def call_with_reconnect(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`; when it fails because this thread's connection is broken (not an error on a live
    connection), close the connection and call again, with backoff, for up to RETRY_FOR_S seconds.

    Only outside a transaction: the whole atomic block is what must be retried, and its caller is (`fn` opens it)."""
    deadline, delay = time.monotonic() + RETRY_FOR_S, 0.2
    while True:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if connection.in_atomic_block or not _broken() or time.monotonic() + delay > deadline:
                raise
            logger.warning("database connection lost in %s (%s); reconnecting in %.1f s",
                           getattr(fn, "__qualname__", fn), str(exc).strip(), delay)
            try:
                connection.close()
            except Exception:  # closing a dead connection may fail too; it is dropped either way
                logger.debug("closing the broken connection failed", exc_info=True)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _broken() -> bool:
    return connection.connection is None or not connection.is_usable()


def db(fn: Callable[..., T]) -> Callable[..., Any]:
    """`sync_to_async(fn)` whose calls reconnect as `call_with_reconnect` does (the run's async code's ORM calls)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        _name_orm_thread()
        return call_with_reconnect(fn, *args, **kwargs)

    return sync_to_async(call)


_named = threading.local()
"""Whether this thread was given its kernel name already (one write per thread, not one per call)."""


def _name_orm_thread() -> None:
    """Name the thread these calls run on `orm` for the kernel (asgiref's one thread for thread-sensitive calls
    outside async_to_sync): a worker's recorder writes there, which `top -H` and bench/run_profile.py then show.
    Never the main thread, whose name is the process's."""
    if not getattr(_named, "done", False) and threading.current_thread() is not threading.main_thread():
        name_os_thread("orm")
    _named.done = True
