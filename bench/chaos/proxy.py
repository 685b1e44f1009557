"""A TCP proxy in its own process, in front of a database, that cuts every open connection on SIGUSR1.

    python -m bench.chaos.proxy --port LISTEN --target-port PORT

Connections are forwarded to ``127.0.0.1:PORT`` (asyncio, on uvloop when installed). On
``SIGUSR1`` every connection open at that moment is closed at once in both directions, which
a client sees as the database going away mid-statement or mid-transaction; new connections
are accepted again immediately. A connection the database refuses (it is down) is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

__all__ = ["main"]


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.open: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pair = {writer, up_writer}
        self.open |= pair
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self.open -= pair
            for w in pair:
                w.close()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    def cut(self) -> None:
        for writer in list(self.open):
            transport = writer.transport
            transport.abort()  # RST, no graceful close: as a broken network or a dead peer looks
        self.open.clear()


async def serve(port: int, target_port: int) -> None:
    proxy = Proxy(target_port)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port, reuse_address=True, backlog=512)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.cut)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("proxy ready", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target-port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        pass
    asyncio.run(serve(args.port, args.target_port))


if __name__ == "__main__":
    main()
