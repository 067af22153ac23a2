"""A real redis-server (or valkey-server) on a loopback port chosen at run time, for the tier
tests, and a small fault-injecting TCP proxy in front of it. No mocks: the store under test
speaks the real protocol to a real server.

A missing server is a failure with the install command, not a skip: .ci/run installs it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis


def server_binary() -> str:
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "the tier tests need a Redis or Valkey server: apt-get install -y redis-server "
        "(.ci/run installs it)",
        pytrace=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One server process; `stop` kills it (a dead store), `start` brings it back empty."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                server_binary(),
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


class FaultProxy:
    """A TCP proxy in front of a server; `transform(reply_bytes)` rewrites each chunk the
    server sends back (corrupt, truncate), `delay` holds every reply that long."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.transform: Callable[[bytes], bytes] | None = None
        self.delay = 0.0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            if self._closed:  # close() ran while this connection was being set up
                client.close()
                upstream.close()
                return
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if replies:
                    if self.delay:
                        time.sleep(self.delay)
                    if self.transform is not None:
                        data = self.transform(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            sock.close()


# -- fixtures shared by the tests that need a live server (import them by name) -------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    instance = RedisServer()
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the module's server, emptied first (restarted if a test stopped it)."""
    if server.process is None:
        server.start()
    raw = redis.Redis.from_url(server.url)
    raw.flushall()
    yield raw
    raw.close()
