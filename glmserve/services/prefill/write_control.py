"""How a prefill worker or stage follows a KV write from the event loop: wait until it is final,
ask it to stop. Both run the backend's blocking calls on a thread, never on the loop."""

from __future__ import annotations

import asyncio
import logging
import threading

from glmserve.kv.transfer import KVTransferBackend, TransferError, TransferHandle

log = logging.getLogger(__name__)


def request_cancel(backend: KVTransferBackend, handle: TransferHandle) -> None:
    """Ask the write to stop without blocking the loop; whoever awaits ``wait_final`` sees it end."""

    def cancel() -> None:
        try:
            backend.cancel(handle)
        except TransferError as e:  # not drained: the handle says so, the job reports it
            log.warning("cancel of %s: %s", handle, e)

    threading.Thread(target=cancel, name="kv-cancel", daemon=True).start()


async def wait_final(handle: TransferHandle) -> None:
    """Wait (off the loop) until the write is done or failed; backends always get there."""
    loop = asyncio.get_running_loop()
    final: asyncio.Future[None] = loop.create_future()

    def wait() -> None:
        handle.wait()
        loop.call_soon_threadsafe(lambda: final.done() or final.set_result(None))

    threading.Thread(target=wait, name="kv-wait", daemon=True).start()
    await final
