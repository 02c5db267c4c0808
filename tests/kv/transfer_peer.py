"""A KV transfer receiver in a second process, for tests and benchmarks.

``ReceiverProcess.start(kind, num_blocks, block_bytes)`` starts ``python -m tests.kv.transfer_peer``
(a plain subprocess: no multiprocessing re-import of the caller's main module), which owns a cache
buffer of seeded random bf16 values, registers it with a transfer backend and answers commands over
a socketpair: its ``target_info``, per-block digests, the next completion, a stamp check, quit.
``kill()`` is kill -9.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from glmserve.kv.transfer import TransferStamp, make_backend, verify_stamp


def _serve(
    conn: Connection, kind: str, num_blocks: int, block_bytes: int, seed: int, env: dict[str, str]
) -> None:
    os.environ.update(env)
    gen = torch.Generator().manual_seed(seed)
    # bf16 rows like the real cache: one row = one block.
    buffer = torch.randn(num_blocks, block_bytes // 2, generator=gen).to(torch.bfloat16)
    backend = make_backend(kind)
    backend.register(buffer)
    conn.send(backend.target_info())
    seen: dict[str, list[TransferStamp]] = {}  # completions by request id
    snapshot = buffer.clone()
    while True:
        cmd, *args = conn.recv()
        if cmd == "digests":
            conn.send(
                [hashlib.blake2b(buffer[i].view(torch.uint8).numpy()).digest() for i in range(num_blocks)]
            )
        elif cmd == "snapshot":  # a memcpy: milliseconds, so late bytes cannot hide in its window
            snapshot.copy_(buffer)
            conn.send("ok")
        elif cmd == "read":  # bytes of one block
            conn.send(bytes(buffer[args[0]].view(torch.uint8).numpy()))
        elif cmd == "changed":  # blocks that differ from the snapshot
            conn.send([i for i in range(num_blocks) if not torch.equal(buffer[i], snapshot[i])])
        elif cmd == "wait":  # the next completion of request args[1], or None after args[0] seconds
            deadline, request_id = time.monotonic() + args[0], args[1]
            while not seen.get(request_id) and time.monotonic() < deadline:
                for stamp in backend.completions():
                    seen.setdefault(stamp.request_id, []).append(stamp)
                time.sleep(0.002)
            conn.send(seen[request_id].pop(0).encode() if seen.get(request_id) else None)
        elif cmd == "verify":  # stamp bytes, request id, generation, dst ids -> "ok" or the error
            stamp_bytes, request_id, generation, dst = args
            try:
                stamp = TransferStamp.decode(stamp_bytes)
                verify_stamp(
                    stamp, request_id=request_id, generation=generation, buffer=buffer, block_ids=dst
                )
                conn.send("ok")
            except Exception as e:
                conn.send(f"{type(e).__name__}: {e}")
        elif cmd == "quit":
            backend.close()
            conn.send("bye")
            return


class ReceiverProcess:
    def __init__(self, process: subprocess.Popen, conn: Connection, num_blocks: int) -> None:
        self.process, self.conn, self.num_blocks = process, conn, num_blocks
        self.target_info = b""

    @classmethod
    def start(
        cls, kind: str, num_blocks: int, block_bytes: int, *, seed: int = 0, env: dict[str, str] | None = None
    ) -> ReceiverProcess:
        return cls.launch(kind, num_blocks, block_bytes, seed=seed, env=env).ready()

    @classmethod
    def launch(
        cls, kind: str, num_blocks: int, block_bytes: int, *, seed: int = 0, env: dict[str, str] | None = None
    ) -> ReceiverProcess:
        """Start the process without waiting for it (``ready`` waits): launch several, then wait."""
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-m", "tests.kv.transfer_peer", "--fd", str(theirs.fileno()), "--kind", kind,
                "--num-blocks", str(num_blocks), "--block-bytes", str(block_bytes), "--seed", str(seed),
                "--env", json.dumps(env or {})]  # fmt: skip
        root = Path(__file__).resolve().parents[2]
        process = subprocess.Popen(args, cwd=root, pass_fds=[theirs.fileno()])
        theirs.close()
        return cls(process, Connection(ours.detach()), num_blocks)

    def ready(self, timeout: float = 60.0) -> ReceiverProcess:
        if not self.target_info:
            self.target_info = self._answer("start", timeout)
        return self

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        return self._answer(cmd[0], timeout)

    def _answer(self, what: str, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"receiver did not answer {what!r} within {timeout} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"receiver exited (code {self.process.wait(5)}) before answering {what!r}"
            ) from None

    def digests(self) -> list[bytes]:
        return self.call("digests")

    def snapshot(self) -> None:
        self.call("snapshot")

    def read(self, block_id: int) -> bytes:
        return self.call("read", block_id)

    def changed_since_snapshot(self) -> list[int]:
        return self.call("changed")

    def wait_completion(self, request_id: str, timeout: float) -> TransferStamp | None:
        """The next completion for ``request_id``, or None after ``timeout`` seconds."""
        data = self.call("wait", timeout, request_id, timeout=timeout + 30)
        return None if data is None else TransferStamp.decode(data)

    def verify(self, stamp: TransferStamp, request_id: str, generation: int, dst: list[int]) -> str:
        return self.call("verify", stamp.encode(), request_id, generation, dst)

    def kill(self) -> None:
        """kill -9."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.call("quit", timeout=10)
                self.process.wait(10)
            except (TimeoutError, OSError, RuntimeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)
        self.conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag in ("--fd", "--num-blocks", "--block-bytes", "--seed"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--env", default="{}")
    a = parser.parse_args()
    _serve(Connection(a.fd), a.kind, a.num_blocks, a.block_bytes, a.seed, json.loads(a.env))


if __name__ == "__main__":
    main()


# -- scenarios shared by the NIXL and TCP tests --------------------------------------------------


def make_source(num_blocks: int, block_bytes: int, seed: int = 1) -> torch.Tensor:
    """A writer's cache: seeded random bf16 rows, one row = one block."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_bytes // 2, generator=gen).to(torch.bfloat16)


def row_digest(buffer: torch.Tensor, block_id: int) -> bytes:
    return hashlib.blake2b(buffer[block_id].view(torch.uint8).numpy()).digest()


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.0005)


def check_exact_write(writer: Any, peer: str, receiver: ReceiverProcess, src: torch.Tensor) -> None:
    """Non-contiguous blocks land exactly where asked, the stamp verifies, nothing else changes."""
    from glmserve.kv.transfer import TransferStamp

    before = receiver.digests()
    src_ids, dst_ids = [3, 40, 11], [7, 2, 5]
    stamp = TransferStamp("req-exact", 3).with_checksum(src, src_ids)
    handle = writer.write(peer, stamp, src_ids, dst_ids)
    assert handle.wait(20) == "done", handle.error
    assert writer.poll(handle) == "done" and handle.drained
    assert receiver.wait_completion("req-exact", 10) == stamp
    assert receiver.verify(stamp, "req-exact", 3, dst_ids) == "ok"
    assert receiver.verify(stamp, "req-exact", 4, dst_ids).startswith("StaleTransferError")
    assert receiver.verify(stamp, "req-exact", 3, [2, 7, 5]).startswith("ChecksumMismatchError")
    after = receiver.digests()
    for block in range(len(after)):
        expected = row_digest(src, src_ids[dst_ids.index(block)]) if block in dst_ids else before[block]
        assert after[block] == expected, f"block {block}"


def check_window_write(writer_factory: Any, receiver: ReceiverProcess, block_bytes: int) -> None:
    """A `BlockWindow` moves only its bytes: from an offset of the writer's (larger) rows to an offset
    of the receiver's; the rest of each destination row is untouched; a part stamp's checksum
    covers exactly the window."""
    import pytest

    from glmserve.kv.transfer import BlockWindow, StampPart, TransferStamp

    src = make_source(6, 2 * block_bytes, seed=5)
    writer = writer_factory(src)
    try:
        window = BlockWindow(block_bytes + 4096, block_bytes // 4, block_bytes // 2)
        peer = writer.connect(receiver.target_info, window)
        assert peer != writer.connect(receiver.target_info, BlockWindow(0, 0, block_bytes))  # a peer per window
        before = {d: receiver.read(d) for d in (9, 4)}
        part = StampPart(1, 2, 0, 1, 0, 2, window.dst_offset, window.length)
        stamp = TransferStamp("req-window", 1, part=part).with_checksum(src, [2, 5], window.src_offset, window.length)
        handle = writer.write(peer, stamp, [2, 5], [9, 4])
        assert handle.wait(20) == "done", handle.error
        assert handle.num_bytes == 2 * window.length
        assert receiver.wait_completion("req-window", 10) == stamp
        assert receiver.verify(stamp, "req-window", 1, [9, 4]) == "ok"
        lo, hi = window.dst_offset, window.dst_offset + window.length
        for s_row, d in ((2, 9), (5, 4)):
            got, old = receiver.read(d), before[d]
            want = bytes(src[s_row].view(torch.uint8).numpy())[window.src_offset : window.src_offset + window.length]
            assert got[lo:hi] == want and got[:lo] == old[:lo] and got[hi:] == old[hi:]
        with pytest.raises(ValueError, match="window"):
            writer.connect(receiver.target_info, BlockWindow(0, block_bytes // 2, block_bytes))
        with pytest.raises(ValueError, match="block size"):
            writer.connect(receiver.target_info)
    finally:
        writer.close()


def check_cancel_drains(
    writer: Any,
    peer: str,
    receiver: ReceiverProcess,
    num_blocks: int = 64,
    after_s: float | None = None,
    first_src: int = 0,
) -> tuple[int, str | None]:
    """Cancel a large write of source blocks ``first_src, ...`` once its first bytes moved (or
    ``after_s`` seconds after it started): after cancel returns, the destination never changes again
    and no completion arrives. Returns how many destination blocks were written, and the handle's
    error. (Use another ``first_src`` per call on one receiver: rewriting equal bytes is invisible.)"""
    from glmserve.kv.transfer import TransferStamp

    receiver.snapshot()
    total = receiver.num_blocks
    src_ids = list(range(first_src, first_src + num_blocks))
    dst_ids = list(range(total - num_blocks, total))
    handle = writer.write(peer, TransferStamp("req-cancel", 1), src_ids, dst_ids)
    if after_s is None:
        wait_for(lambda: handle.bytes_done > 0 or handle.state != "pending", 20, "no bytes moved")
    else:
        time.sleep(after_s)
    writer.cancel(handle, timeout=10)
    landed = receiver.changed_since_snapshot()
    receiver.snapshot()
    assert handle.drained and writer.poll(handle) == "failed" and handle.cancelled, (
        handle.state,
        handle.error,
    )
    time.sleep(0.3)
    assert receiver.changed_since_snapshot() == [], "destination blocks changed after cancel returned"
    assert receiver.wait_completion("req-cancel", 0.2) is None
    assert set(landed) <= set(dst_ids)
    return len(landed), handle.error


def check_peer_death(writer: Any, receiver: ReceiverProcess) -> float:
    """kill -9 the receiver during a write of all its blocks: the write fails within a bounded time,
    later writes fail, and cancel refuses to claim a drain it cannot confirm. Returns seconds from
    the kill to "failed"."""
    from glmserve.kv.transfer import TransferDrainError, TransferStamp

    try:
        peer = writer.connect(receiver.ready().target_info)
        ids = list(range(receiver.num_blocks))
        handle = writer.write(peer, TransferStamp("req-dead", 1), ids, ids)
        wait_for(lambda: handle.bytes_done > 0 or handle.state != "pending", 20, "no bytes moved")
        killed = time.monotonic()
        receiver.kill()
        assert handle.wait(10) == "failed", f"{handle.state} ({handle.bytes_done} of {handle.num_bytes} B)"
        latency = time.monotonic() - killed
        later = writer.write(peer, TransferStamp("req-dead", 2), [0], [0])
        assert later.wait(10) == "failed"
        assert not handle.drained  # the peer is unreachable: the agreed timeout applies
        try:
            writer.cancel(handle, timeout=5)
            raise AssertionError("cancel claimed a drain towards a dead peer")
        except TransferDrainError:
            pass
        return latency
    finally:
        receiver.stop()
