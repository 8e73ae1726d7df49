"""A deadline on an engine call that cannot be taken back once sent."""

from __future__ import annotations

import asyncio
import logging

from coordinator.engines.contract import EngineError

log = logging.getLogger(__name__)


class DraftTimeout(EngineError):
    """The draft did not answer within the coordinator's draft_timeout_seconds."""


async def with_deadline(call, timeout: float | None):
    """Await an engine call, giving up after ``timeout`` seconds (DraftTimeout).

    The call itself is shielded, not cancelled: an engine request already
    queued in Triton cannot be taken back, so it runs to its end and its
    answer (or error) is dropped."""
    if not timeout or timeout <= 0:
        return await call
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout)
    except asyncio.TimeoutError:
        task.add_done_callback(drop_result)
        raise DraftTimeout(f"draft did not answer within {timeout:g} s (draft_timeout_seconds)") from None


def drop_result(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a late draft call failed after its deadline: %s", task.exception())
