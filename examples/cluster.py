import asyncio
import os

from worqr import Worqr


async def main() -> None:
    # Any reachable node of a Redis Cluster tells the client the rest. A Sentinel-managed
    # master is named alike: redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/orders
    url = os.environ.get("REDIS_CLUSTER_URL", "redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    # wait_replicas=1: enqueue returns once a replica has the tasks (else it raises
    # ReplicationError), so that a failover cannot lose an acknowledged task.
    async with Worqr.from_url(url, prefix="cluster-example", wait_replicas=1) as worqr:
        await worqr.enqueue("orders", ["order-1", "order-2"])
        print(await worqr.count_queue("orders"))  # 2
        await worqr.delete_queue("orders")


asyncio.run(main())
