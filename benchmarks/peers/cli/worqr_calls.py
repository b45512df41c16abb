"""The registry ``worqr worker worqr_calls:tasks`` runs (see tally.py): one task
function on the adapter's queue, an int argument in and an int result out, stored as
the job's result (the function-call drain)."""

from __future__ import annotations

from tally import QUEUE, tick

from worqr import Tasks

tasks = Tasks()


@tasks.task(queue=QUEUE, name="double")
async def double(n: int) -> int:
    tick()
    return 2 * n
