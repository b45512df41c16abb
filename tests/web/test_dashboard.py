"""The dashboard in a real headless Chromium (Debian's, driven by Playwright), served
by a real uvicorn server on a real Redis server: it shows what the fleet does as it
happens, without a reload, and its actions work (or are refused without the token).
With WORQR_WRITE_DOCS=1 the main views go to docs/dashboard-*.png."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from worqr import Context, Process, Tasks
from worqr.web import create_app

from ..helpers import FAST, Factory, consuming, eventually, reap
from .test_web_api import TOKEN, serving

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WITHIN = 15_000  # ms a view may take to show a change (snapshots come every second)


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium; without it the tests are skipped, unless the run requires
    it (CI sets WORQR_REQUIRE_BROWSER=1 after installing it)."""
    if not Path(CHROMIUM).exists():
        why = "the dashboard tests need Chromium: apt-get install chromium"
        if os.environ.get("WORQR_REQUIRE_BROWSER"):
            pytest.fail(why)
        pytest.skip(why)
    return CHROMIUM


@pytest.fixture
async def browser(chromium: str) -> AsyncIterator[Browser]:
    playwright = await async_playwright().start()
    launched = await playwright.chromium.launch(executable_path=chromium, args=FLAGS)
    yield launched
    await launched.close()
    await playwright.stop()


@pytest.fixture
async def page(browser: Browser, redis_url: str, prefix: str) -> AsyncIterator[Page]:
    """The dashboard of the test's prefix, open, with the token typed in."""
    async with serving(create_app(redis_url, token=TOKEN, prefix=prefix)) as base:
        opened = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await opened.goto(f"{base}/")
        await opened.fill("#token", TOKEN)
        await opened.dispatch_event("#token", "change")
        await opened.evaluate("window.loadedOnce = true")  # gone if the page reloads
        yield opened
        await opened.close()


def row(page: Page, queue: str) -> Locator:
    return page.locator(f'#queues tr[data-queue="{queue}"]')


async def not_reloaded(page: Page) -> None:
    assert await page.evaluate("window.loadedOnce") is True


async def screenshot(page: Page, name: str) -> None:
    """Write docs/dashboard-<name>.png when the docs are being written."""
    if os.environ.get("WORQR_WRITE_DOCS"):
        await page.screenshot(path=ROOT / "docs" / f"dashboard-{name}.png", full_page=True)


async def test_the_page_shows_a_queue_filling_and_draining_without_a_reload(
    page: Page, real_make: Factory
) -> None:
    producer, worker = real_make(), real_make()
    await producer.enqueue("emails", ["ada", "alan", "grace"])
    ready = row(page, "emails").locator("td.ready")
    await expect(ready).to_have_text("3", timeout=WITHIN)
    await producer.enqueue("emails", ["barbara", "edsger"])
    await expect(ready).to_have_text("5", timeout=WITHIN)

    async def handler(process: Process) -> str:
        return "sent"

    await producer.schedule("nightly-digest", "emails", "digest", cron="0 3 * * *")
    schedule = page.locator("#schedules tbody tr").filter(has_text="nightly-digest")
    await expect(schedule).to_contain_text("0 3 * * *", timeout=WITHIN)
    await expect(schedule).to_contain_text(" 03:00:00")  # its next tick
    async with consuming(worker, handler, queue="emails"):
        await expect(ready).to_have_text("0", timeout=WITHIN)
        await expect(page.locator("#rate")).not_to_have_text("0.0", timeout=WITHIN)
        await expect(page.locator("#latency")).not_to_have_text("-", timeout=WITHIN)
        await screenshot(page, "overview")
    await not_reloaded(page)


async def test_the_page_loads_with_its_icon_and_no_console_error(
    browser: Browser, real_make: Factory, redis_url: str, prefix: str
) -> None:
    await real_make().enqueue("emails", ["ada"])
    errors: list[str] = []
    icons: list[int] = []
    async with serving(create_app(redis_url, prefix=prefix)) as base:
        opened = await browser.new_page()
        opened.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        opened.on("pageerror", lambda exc: errors.append(str(exc)))
        opened.on("response", lambda r: icons.append(r.status) if "favicon" in r.url else None)
        await opened.goto(f"{base}/")
        await expect(row(opened, "emails").locator("td.ready")).to_have_text("1", timeout=WITHIN)
        await eventually(lambda: bool(icons), within=WITHIN / 1000)
        await opened.close()
    assert icons == [200]
    assert errors == []


async def test_a_sigkilled_worker_shows_dead_and_its_tasks_come_back(
    page: Page, real_make: Factory, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    (tmp_path / "slow.py").write_text(
        textwrap.dedent(
            """
            import anyio

            async def hold(process):
                await anyio.sleep_forever()
            """
        )
    )
    producer = real_make()
    await producer.enqueue("reports", ["r1", "r2", "r3"])
    argv = [sys.executable, "-m", "worqr", "--url", redis_url, "--prefix", prefix]
    argv += ["worker", "slow:hold", "reports", "--concurrency", "2", "--worker-id", "box-7:1"]
    argv += ["--heartbeat-interval", "0.2", "--worker-timeout", "1.5", "-q"]
    child = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        worker_row = page.locator('#workers tr[data-worker="box-7:1"]')
        await expect(worker_row).to_contain_text("box-7", timeout=WITHIN)
        await expect(page.locator("#processes tbody tr")).to_have_count(2, timeout=WITHIN)
        await screenshot(page, "processes")
        child.send_signal(signal.SIGKILL)
        await expect(worker_row).to_have_class("dead", timeout=WITHIN)
        await expect(worker_row).to_contain_text("dead")
        await screenshot(page, "dead-worker")
    finally:
        reap(child)
    survivor = real_make(**FAST)
    await survivor.start_worker()  # a live peer: it reclaims the dead one's processes
    ready = row(page, "reports").locator("td.ready")
    await expect(ready).to_have_text("3", timeout=WITHIN)
    await expect(worker_row).to_have_count(0, timeout=WITHIN)
    assert await producer.get_tasks("reports") == ["r1", "r2", "r3"]
    await not_reloaded(page)


async def test_a_failed_entry_is_retried_from_the_page(page: Page, real_make: Factory) -> None:
    producer, worker = real_make(), real_make()

    async def fail(process: Process) -> None:
        raise ValueError(f"cannot render {process.task}")

    await producer.enqueue("renders", ["page-1", "page-2"])
    async with consuming(worker, fail, queue="renders"):

        async def failed() -> bool:
            return len(await producer.get_failed("renders")) == 2

        await eventually(failed)
    await row(page, "renders").locator("td.num button").click()
    entries = page.locator("#failed tr[data-entry]")
    await expect(entries).to_have_count(2, timeout=WITHIN)
    await expect(entries.first).to_contain_text("ValueError: cannot render page-1")
    await entries.first.locator("summary").click()
    await expect(entries.first.locator("pre")).to_contain_text("Traceback")
    await screenshot(page, "failed")
    await entries.first.get_by_role("button", name="retry").click()
    await expect(entries).to_have_count(1, timeout=WITHIN)
    assert await producer.get_tasks("renders") == ["page-1"]
    await not_reloaded(page)


async def test_an_action_without_the_token_is_refused(page: Page, real_make: Factory) -> None:
    producer = real_make()
    await producer.enqueue("keep", "t")
    await expect(row(page, "keep")).to_have_count(1, timeout=WITHIN)
    await page.fill("#token", "")
    await page.dispatch_event("#token", "change")
    page.once("dialog", lambda dialog: dialog.accept())
    await row(page, "keep").get_by_role("button", name="delete").click()
    await expect(page.locator("#message")).to_contain_text("unauthorized", timeout=WITHIN)
    assert await producer.get_tasks("keep") == ["t"]
    await page.fill("#token", TOKEN)
    await page.dispatch_event("#token", "change")
    await row(page, "keep").get_by_role("button", name="pause").click()
    await eventually(lambda: producer.is_paused("keep"))  # the action took effect,
    await expect(row(page, "keep")).to_contain_text("paused", timeout=WITHIN)  # and shows


async def test_a_running_call_shows_its_function_and_progress(
    page: Page, real_make: Factory
) -> None:
    tasks = Tasks(queue="renders")

    @tasks.task(name="render")
    async def render(ctx: Context, scene: str) -> None:
        await ctx.progress(0.4, "lighting")
        await anyio.sleep_forever()

    worker = real_make()
    await render.submit(worker, "castle")
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: worker.serve(tasks))
        shown = page.locator("#processes tbody tr")
        await expect(shown).to_contain_text('render {"scene":"castle"}', timeout=WITHIN)
        await expect(shown.locator("td.progress")).to_have_text("40% lighting", timeout=WITHIN)
        await screenshot(page, "progress")
        group.cancel_scope.cancel()
