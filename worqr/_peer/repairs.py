"""The repair of one problem that `Worqr.check` found: the operation that fixes it,
re-checked under WATCH before it writes (see `_ops.repairs`)."""

from __future__ import annotations

from .. import _ops
from .._ops.check import Problem
from .holdings import Parts, Timing
from .leases import Leases


async def repair_problem(parts: Parts, problem: Problem, leases: Leases, timing: Timing) -> None:
    """Fix ``problem``; a dead worker's processes are reclaimed as any dead worker's."""
    r, keys = parts.redis, parts.keys
    queue, worker_id, pid = problem.queue, problem.worker_id, problem.process_id
    if problem.kind == "orphan-process" and queue and pid:
        await _ops.repairs.return_orphan(r, keys, queue, pid)
    elif problem.kind == "malformed-process" and queue and pid:
        await _ops.repairs.trim_process(r, keys, queue, pid)
    elif problem.kind == "dangling-process-id" and queue and worker_id and pid:
        await _ops.repairs.drop_process_id(r, keys, queue, worker_id, pid)
    elif problem.kind == "dead-worker" and worker_id:
        await leases.fail_dead(worker_id, only_if_dead=True)
    elif problem.kind == "stale-holder" and queue and worker_id:
        await _ops.repairs.drop_holder(r, keys, queue, worker_id)
    elif problem.kind == "stale-work-list" and worker_id:
        await _ops.repairs.drop_work_list(r, keys, worker_id)
    elif problem.kind == "unregistered-worker" and worker_id:
        await _ops.commands.register(r, keys.workers, worker_id)
    elif problem.kind == "unregistered-queue" and queue:
        await _ops.commands.register(r, keys.queues, queue)
    elif problem.kind == "wrong-type" and problem.key:
        kind = keys.type_of(problem.key)
        if kind is not None:
            await _ops.repairs.drop_wrong_type(r, problem.key, kind)
            parts.log.warning("deleted %s: it had the wrong type", problem.key)
    elif problem.kind == "stale-deadline" and queue and pid:
        await _ops.repairs.drop_deadline(r, keys, queue, pid)
    elif problem.kind in ("dangling-job", "unindexed-job", "lost-job") and queue and problem.key:
        parsed = keys.parse(problem.key)
        if parsed is not None and parsed[0] == "j":
            if problem.kind == "dangling-job":
                await _ops.repairs.drop_job_index(r, keys, queue, parsed[2])
            elif problem.kind == "unindexed-job":
                await _ops.repairs.index_job(r, keys, queue, parsed[2])
            else:
                now = await parts.clock.now_ms(r)
                await _ops.repairs.end_lost_job(r, keys, queue, parsed[2], now)
    elif problem.kind == "stuck-waiting" and queue and problem.key:
        parsed = keys.parse(problem.key)
        if parsed is not None and parsed[0] == "j":
            await _ops.deps.hand_to_release(r, keys, queue, parsed[2])
    elif problem.kind == "unreadable-flow" and queue:
        await _ops.flow.set_rate_limit(r, keys, queue, None, 0)  # what cannot be read
    elif problem.kind in ("unreadable-schedule", "orphan-schedule") and queue and problem.key:
        parsed = keys.parse(problem.key)
        if parsed is not None and parsed[0] == "s" and problem.kind == "orphan-schedule":
            await _ops.schedules.drop_orphan(r, keys, queue, parsed[2])
        elif parsed is not None and parsed[0] == "s":
            await _ops.schedules.drop(r, keys, queue, parsed[2])
            parts.log.warning("removed %s: no worker can run it", problem.key)
    elif problem.kind == "no-expiry" and problem.key:
        # An expiry, not a delete: a live worker's next heartbeat renews it.
        await _ops.repairs.expire_endless(r, problem.key, timing.timeout_ms)
