"""The kvstore service in a thread of the test process, on 127.0.0.1 (restartable on the same port)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from glmserve.services.kvstore.client import KVStoreClient
from glmserve.services.kvstore.main import KVStoreConfig, serve


@contextmanager
def kvstore(port: int, **config: object) -> Iterator[KVStoreClient]:
    """A kvstore on ``port`` until the block ends; ``config``: more `KVStoreConfig` fields."""
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(KVStoreConfig(port=port, grace_s=0.1, **config), stop),
                              daemon=True)
    thread.start()
    client = KVStoreClient(f"127.0.0.1:{port}", timeout_s=2.0)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.health()
            break
        except Exception:
            assert time.monotonic() < deadline, "kvstore did not start"
            time.sleep(0.05)
    try:
        yield client
    finally:
        client.close()
        stop.set()
        thread.join(timeout=10)
