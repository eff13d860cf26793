"""A kv_producer's ZeroMQ port, as far as releases go: records the leases a front releases
(what a real producer would free at once instead of at lease_s)."""

from __future__ import annotations

import time

import msgspec
import zmq

from kvserve.kv_transfer.release import Release


class ReleaseListener:
    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._decoder = msgspec.msgpack.Decoder(Release)
        self.handles: list[str] = []

    def wait(self, n: int, timeout: float = 10.0) -> list[str]:
        """The handles released so far, waiting up to `timeout` s for `n` of them."""
        deadline = time.monotonic() + timeout
        while len(self.handles) < n and (left := deadline - time.monotonic()) > 0:
            if self._sock.poll(int(left * 1000)):
                _, raw = self._sock.recv_multipart()
                self.handles.append(self._decoder.decode(raw).handle)
        return list(self.handles)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
