"""The atomic operations: the only code that writes to Redis.

One module per transition or family of transitions: ``enqueue``, ``submit``,
``promote``, ``dequeue``, ``block`` (the blocking take), ``end`` (finish, fail,
deadlines), ``stop``, ``cancel``, ``queues`` (cancel a task, delete a queue),
``failed``, ``progress``, ``reclaim``, ``workers`` (register, heartbeat, the supervision scan,
fail_worker), ``repairs``, ``deps``, ``flow``, ``schedules``; docs/diagrams/ draws each.
They are built from the round trips of `commands` and the shared write builders of
`writes`; ``inspect`` and ``check`` only read. Every MULTI/EXEC block touches
the keys of one hash slot and runs on the server of that slot (`on_slot`); registry
updates (other slots) are separate single-key commands ordered so that a crash
between them loses nothing (docs/diagrams/cluster.md gives the argument).

The layers above call a transition by its module: ``_ops.enqueue.enqueue(...)``,
``_ops.reclaim.reclaim(...)``.
"""

from __future__ import annotations

from . import block as block
from . import cancel as cancel
from . import check as check
from . import commands as commands
from . import deps as deps
from . import dequeue as dequeue
from . import end as end
from . import enqueue as enqueue
from . import failed as failed
from . import flow as flow
from . import inspect as inspect
from . import progress as progress
from . import promote as promote
from . import queues as queues
from . import reclaim as reclaim
from . import repairs as repairs
from . import schedules as schedules
from . import stop as stop
from . import submit as submit
from . import workers as workers
from . import writes as writes
