"""A TCP proxy in its own process, in front of a database, that cuts every open connection on SIGUSR1.

    python -m bench.chaos.proxy --port LISTEN --target-port PORT [--target-host IP] [--control FILE]

Connections are forwarded to ``127.0.0.1:PORT`` (asyncio, on uvloop when installed). On
``SIGUSR1`` every connection open at that moment is closed at once in both directions, which
a client sees as the database going away mid-statement or mid-transaction; new connections
are accepted again immediately. A connection the database refuses (it is down) is closed.

With ``--control FILE``, ``SIGUSR2`` re-reads FILE: one IP address a line, the partitioned hosts.
If the target host is among them, every connection is cut and new ones are refused; otherwise
the connections coming from a listed address are. The Galera harness (``bench.cluster``) puts
one in front of each node's group-communication port, each node on a loopback address of its
own, so that a node is cut off from the others in both directions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

__all__ = ["main"]


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", control: str | None = None) -> None:
        self.target_port = target_port
        self.target_host = target_host
        self.control = control
        self.open: set[asyncio.StreamWriter] = set()
        #: Each accepted connection's upstream connection.
        self.upstream: dict[asyncio.StreamWriter, asyncio.StreamWriter] = {}
        #: Partitioned hosts (``--control``): see the module's docstring.
        self.blocked: set[str] = set()

    def refused(self, writer: asyncio.StreamWriter) -> bool:
        if self.target_host in self.blocked:
            return True
        peer = writer.get_extra_info("peername")
        return bool(peer) and peer[0] in self.blocked

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refused(writer):
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        if self.refused(writer):  # partitioned while connecting upstream
            writer.transport.abort()
            up_writer.transport.abort()
            return
        pair = {writer, up_writer}
        self.open |= pair
        self.upstream[writer] = up_writer
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self.open -= pair
            self.upstream.pop(writer, None)
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

    def reload(self) -> None:
        """Re-read the control file and cut the connections it now refuses."""
        if self.control is None:
            return
        try:
            with open(self.control) as f:
                self.blocked = {line.strip() for line in f if line.strip()}
        except FileNotFoundError:
            self.blocked = set()
        for writer, up_writer in list(self.upstream.items()):
            if self.refused(writer):
                for w in (writer, up_writer):
                    w.transport.abort()
                    self.open.discard(w)


async def serve(
    port: int, target_port: int, target_host: str = "127.0.0.1", control: str | None = None
) -> None:
    proxy = Proxy(target_port, target_host, control)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port, reuse_address=True, backlog=512)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.cut)
    loop.add_signal_handler(signal.SIGUSR2, proxy.reload)
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
    parser.add_argument("--target-host", default="127.0.0.1")
    parser.add_argument("--control", default=None, help="file of partitioned hosts, re-read on SIGUSR2")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        pass
    asyncio.run(serve(args.port, args.target_port, args.target_host, args.control))


if __name__ == "__main__":
    main()
