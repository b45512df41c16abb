import anyio
import pytest

from app.tasks import send_email  # the Quickstart's handler, in app/tasks.py


@pytest.mark.asyncio
async def test_send_email(worqr):
    job = await worqr.submit("emails", "ada@example.com")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worqr.consume, "emails", send_email)
        assert await job.result(timeout=10) == "sent to ada@example.com"
        tg.cancel_scope.cancel()
