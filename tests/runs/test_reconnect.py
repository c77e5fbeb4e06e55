"""runs.reconnect: a call whose connection PostgreSQL cut (pg_terminate_backend, as a restart does) reconnects."""
import asyncio

import pytest
from django.db import OperationalError, connection, connections, transaction

from runs import reconnect
from runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def cut_own_connection() -> None:
    """Terminate this thread's backend from another session: the connection object still looks open."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()


@pytest.fixture(autouse=True)
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("cuts a PostgreSQL connection")


def test_a_plain_query_on_a_cut_connection_fails_and_keeps_failing():  # why the module exists
    cut_own_connection()
    for _ in range(2):
        with pytest.raises((OperationalError,)):
            Run.objects.count()
    connection.close()


def test_it_reconnects_and_returns_the_answer(alice, make_run):
    make_run(alice)
    cut_own_connection()
    assert reconnect.call_with_reconnect(Run.objects.count) == 1
    assert connection.is_usable()


def test_the_async_wrapper_reconnects_its_thread(alice, make_run):
    run = make_run(alice)

    async def go():
        await reconnect.db(cut_own_connection)()
        try:
            return await reconnect.db(lambda: Run.objects.get(pk=run.pk).name)()
        finally:
            await reconnect.db(lambda: connection.close())()  # the executor thread's own connection

    assert asyncio.run(go()) == run.name


def test_an_error_on_a_live_connection_is_not_retried():
    calls = []

    def bad():
        calls.append(1)
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table_here")

    with pytest.raises(Exception, match="no_such_table_here"):
        reconnect.call_with_reconnect(bad)
    assert calls == [1]


def test_inside_a_transaction_it_leaves_the_retry_to_the_caller(alice, make_run):
    make_run(alice)
    with pytest.raises(OperationalError):
        with transaction.atomic():
            cut_own_connection()
            reconnect.call_with_reconnect(Run.objects.count)
    assert reconnect.call_with_reconnect(Run.objects.count) == 1
