"""The router's listening socket: connections accepted on it stream without Nagle's delay."""

from __future__ import annotations

import asyncio
import socket

from glmserve.services.router.main import _bind


def test_accepted_connections_have_nagle_off():
    """asyncio sets TCP_NODELAY only on connections of an IPPROTO_TCP socket; with Nagle on, a
    stream's first SSE chunk waited ~40 ms behind the response headers on keep-alive connections."""

    async def accepted_nodelay() -> int:
        sock = _bind("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            try:
                return await asyncio.wait_for(seen, 5.0)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0
