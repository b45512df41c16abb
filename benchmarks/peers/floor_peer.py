"""The floor of a result round trip on this host: no queue library, the fewest Redis
commands a round trip through a worker process can take (see common.py for the modes).

``worker`` is one process that waits in ``BLPOP`` on a list and, for each item, sends
``PUBLISH`` of it on a channel (its "result"). ``roundtrip`` ``RPUSH``es a payload and
waits for it on that channel, to which it subscribed once beforehand. One redis-py
asyncio client per process, with hiredis, under uvloop, as the libraries run: what
any Redis work queue must at least spend here (two processes woken, four hops on
loopback), so that the round trip of each library can be read against it. It runs
with worqr's environment (redis-py, hiredis and uvloop).
"""

from __future__ import annotations

from common import emit, parse_args, round_trips, run, say, started
from redis.asyncio import Redis

ARGS = parse_args()
CHANNEL = "floor:results"


async def worker() -> None:
    redis = Redis.from_url(ARGS.url)
    say("ready")
    while True:
        popped = await redis.blpop([ARGS.queue], timeout=0)
        if popped is None:
            continue
        payload = popped[1].decode()
        started(payload)
        await redis.publish(CHANNEL, payload)


async def roundtrip() -> None:
    redis = Redis.from_url(ARGS.url)
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(CHANNEL)
        while await pubsub.get_message(timeout=1.0) is None:
            pass  # the subscription's confirmation

        async def once(payload: str) -> str:
            await redis.rpush(ARGS.queue, payload)
            while True:
                message = await pubsub.get_message(timeout=5.0)
                if message is not None and message["type"] == "message":
                    return str(message["data"].decode())

        await round_trips(ARGS.n, ARGS.interval, once)
    await redis.aclose()


MODES = {"worker": worker, "roundtrip": roundtrip}
if ARGS.mode in MODES:
    run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
else:
    emit({"unsupported": f"the floor has no {ARGS.mode} mode"})
