"""worqr: a peer-supervised, reliable work queue for asyncio on Redis."""

from ._errors import AuthenticationFailedError as AuthenticationFailedError
from ._errors import BackendError as BackendError
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import ClosedError as ClosedError
from ._errors import CorruptDataError as CorruptDataError
from ._errors import DependencyError as DependencyError
from ._errors import DuplicateTaskError as DuplicateTaskError
from ._errors import InvalidJobIdError as InvalidJobIdError
from ._errors import InvalidProcessIdError as InvalidProcessIdError
from ._errors import InvalidQueueNameError as InvalidQueueNameError
from ._errors import InvalidTaskError as InvalidTaskError
from ._errors import InvalidWorkerIdError as InvalidWorkerIdError
from ._errors import JobFailedError as JobFailedError
from ._errors import NotWorkingError as NotWorkingError
from ._errors import PermissionDeniedError as PermissionDeniedError
from ._errors import ProtocolVersionError as ProtocolVersionError
from ._errors import ReplicationError as ReplicationError
from ._errors import ServerStartError as ServerStartError
from ._errors import WorkerNotStartedError as WorkerNotStartedError
from ._errors import WorqrError as WorqrError
from ._job import Job as Job
from ._layout.flow import RateLimit as RateLimit
from ._layout.jobs import Backoff as Backoff
from ._layout.jobs import JobInfo as JobInfo
from ._layout.jobs import JobStatus as JobStatus
from ._layout.jobs import Retry as Retry
from ._layout.models import FailedTask as FailedTask
from ._layout.models import Listener as Listener
from ._layout.models import Process as Process
from ._layout.models import QueueStatistics as QueueStatistics
from ._layout.models import WorkerInfo as WorkerInfo
from ._layout.schedules import ScheduleInfo as ScheduleInfo
from ._ops.check import CheckReport as CheckReport
from ._ops.check import Problem as Problem
from ._peer.events import Subscribed as Subscribed
from ._tasks.context import Context as Context
from ._tasks.registry import Tasks as Tasks
from ._tasks.task import Task as Task
from ._tasks.task import TaskCall as TaskCall
from ._tasks.task import TaskJob as TaskJob
from ._worqr import Worqr as Worqr

__version__ = "0.4.0"

__all__ = [
    "AuthenticationFailedError",
    "BackendError",
    "BackendUnavailableError",
    "Backoff",
    "CheckReport",
    "ClosedError",
    "Context",
    "CorruptDataError",
    "DependencyError",
    "DuplicateTaskError",
    "FailedTask",
    "InvalidJobIdError",
    "InvalidProcessIdError",
    "InvalidQueueNameError",
    "InvalidTaskError",
    "InvalidWorkerIdError",
    "Job",
    "JobFailedError",
    "JobInfo",
    "JobStatus",
    "Listener",
    "NotWorkingError",
    "PermissionDeniedError",
    "Problem",
    "Process",
    "ProtocolVersionError",
    "QueueStatistics",
    "RateLimit",
    "ReplicationError",
    "Retry",
    "ScheduleInfo",
    "ServerStartError",
    "Subscribed",
    "Task",
    "TaskCall",
    "TaskJob",
    "Tasks",
    "WorkerInfo",
    "WorkerNotStartedError",
    "Worqr",
    "WorqrError",
    "__version__",
]
