"""`tcp` and `shm`: the consumer pulls a lease's blocks from the producer over ZeroMQ.

The producer binds a ROUTER socket served by one thread. A pull names the lease, the first
block and the count, and the consumer's layout; the producer copies those blocks out of its
pool, releases the lease (the engine thread frees the blocks) and replies. With `tcp` the
reply carries the blocks as raw frames (no pickling, no copy on send); with `shm` it names a
file in /dev/shm holding them, which the consumer reads and removes (same host, no socket
copy of the payload). A `release` message frees a lease without a transfer: the consumer's
request was aborted. A consumer waits `transfer_timeout_s` for the reply; a producer that
died or hangs makes the consumer compute the prompt itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import msgspec
import numpy as np
import zmq

from kvserve.kv_transfer.block_io import KVBlockIO
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.connector import KVConnector
from kvserve.kv_transfer.params import prompt_digest, remote_prefill
from kvserve.kv_transfer.peers import allowed
from kvserve.kv_transfer.release import PULLED, Release
from kvserve.request import Request

logger = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvserve-kv-"  # a payload file's name; a consumer reads and removes no other


class Pull(msgspec.Struct, tag=True):
    handle: str
    first_block: int
    num_blocks: int
    layout: str


class Reply(msgspec.Struct):
    ok: bool
    error: str = ""
    path: str = ""  # shm: the file holding the payload parts, back to back
    sizes: list[int] = []


_encoder = msgspec.msgpack.Encoder()
_msg_decoder = msgspec.msgpack.Decoder(Pull | Release)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class ZmqConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, io: KVBlockIO, block_size: int) -> None:
        super().__init__(config, io, block_size)
        self.name = config.kv_connector
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._shm_files: dict[str, float] = {}  # producer: path -> written at (removed by the consumer)
        self.port = None
        if config.is_producer:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            host = config.kv_host
            if config.kv_port:
                sock.bind(f"tcp://{host}:{config.kv_port}")
                self.port = config.kv_port
            else:
                self.port = sock.bind_to_random_port(f"tcp://{host}")
            self._server = threading.Thread(target=self._serve, args=(sock,), daemon=True, name="kv-serve")
            self._server.start()
            logger.info("kv transfer (%s): serving leased blocks on %s:%d", self.name, host, self.port)

    def _where(self) -> dict:
        return {"remote_host": self.config.kv_host, "remote_port": self.port}

    # ---- consumer ---------------------------------------------------------------------------
    def num_remote_tokens(self, req: Request, num_local_tokens: int) -> int:
        rp = remote_prefill(req.params.kv_transfer_params)
        if rp is None or not self.config.is_consumer:
            return 0
        if req.params.prompt_logprobs is not None or req.params.pooling:  # every position computed here
            self._send_async(rp, Release(rp.request_id))
            return 0
        if rp.connector != self.name:
            logger.warning("kv transfer: %s names connector %r, this engine runs %r; computing it here",
                           req.request_id, rp.connector, self.name)  # fmt: skip
            if rp.connector in PULLED:  # a ZeroMQ producer all the same: its lease is not needed
                self._send_async(rp, Release(rp.request_id))
            return 0
        n = rp.num_tokens
        if n > req.num_prompt_tokens - 1 or prompt_digest(req.prompt_token_ids[:n]) != rp.digest:
            logger.warning(
                "kv transfer: %s's prompt is not the producer's; computing it here", req.request_id
            )
            self._send_async(rp, Release(rp.request_id))
            return 0
        if n <= num_local_tokens:  # all of it is cached here: the lease is not needed
            self._send_async(rp, Release(rp.request_id))
            return 0
        return n - num_local_tokens

    def cancel(self, req: Request) -> None:
        rp = remote_prefill(req.params.kv_transfer_params)
        if rp is not None:
            self._send_async(rp, Release(rp.request_id))

    def _connect(self, rp) -> zmq.Socket:
        if not allowed(self.config.producer_peers, rp.host, rp.port):  # the processor refused it already
            raise ValueError(f"{rp.host}:{rp.port} is not in kv_producers")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{rp.host}:{rp.port}")
        return sock

    def _send_async(self, rp, msg) -> None:
        """Tell the producer something without waiting for it (fire and forget, bounded)."""

        def send() -> None:
            sock = self._connect(rp)
            sock.setsockopt(zmq.LINGER, int(self.config.transfer_timeout_s * 1000))
            sock.send(_encoder.encode(msg))
            sock.close()

        self._pool.submit(send)

    def _fetch(self, req: Request, first_block: int, num_blocks: int) -> list:
        rp = remote_prefill(req.params.kv_transfer_params)
        sock = self._connect(rp)
        try:
            sock.send(_encoder.encode(Pull(rp.request_id, first_block, num_blocks, self.io.layout)))
            if not sock.poll(int(self.config.transfer_timeout_s * 1000)):
                raise TimeoutError(f"no reply from {rp.host}:{rp.port} in {self.config.transfer_timeout_s}s")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close()
        reply = _reply_decoder.decode(frames[0].buffer)
        if not reply.ok:
            raise RuntimeError(reply.error)
        if not reply.path:
            return [f.buffer for f in frames[1:]]
        if os.path.dirname(reply.path) != SHM_DIR or not os.path.basename(reply.path).startswith(SHM_PREFIX):
            raise RuntimeError(f"{reply.path!r} is not a KV payload file: not read, not removed")
        try:  # shm: read the parts and remove the file
            data = np.fromfile(reply.path, dtype=np.uint8)
        finally:
            try:
                os.unlink(reply.path)
            except OSError:
                pass
        if len(data) != sum(reply.sizes):
            raise RuntimeError(f"{reply.path}: {len(data)} bytes, expected {sum(reply.sizes)}")
        bounds = np.cumsum([0, *reply.sizes])
        return [data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    # ---- producer ---------------------------------------------------------------------------
    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._remove_stale_shm()
                if poller.poll(100):
                    self._handle(sock, *sock.recv_multipart())
            except Exception:  # noqa: BLE001 - one bad message must not stop the server
                logger.exception("kv transfer: serving a request failed")
        sock.close()

    def _handle(self, sock: zmq.Socket, ident: bytes, raw: bytes, *extra: bytes) -> None:
        try:
            msg = _msg_decoder.decode(raw)
        except msgspec.DecodeError:
            return  # not one of ours: no reply
        if isinstance(msg, Release):
            lease = self.leases.take(msg.handle)
            if lease is not None:
                self.leases.release(lease.blocks)
            return
        sock.send_multipart([ident, *self._answer(msg)], copy=False)

    def _answer(self, msg: Pull) -> list:
        lease = self.leases.take(msg.handle)
        if lease is None:
            return [_encoder.encode(Reply(False, f"no lease {msg.handle} (expired or already taken)"))]
        try:
            if msg.layout != self.io.layout:
                return [_encoder.encode(Reply(False, "KV layout differs (model, dtype or block size)"))]
            ids = lease.blocks[msg.first_block : msg.first_block + msg.num_blocks]
            if msg.first_block < 0 or len(ids) != msg.num_blocks:
                return [
                    _encoder.encode(Reply(False, f"blocks {msg.first_block}+{msg.num_blocks} not leased"))
                ]
            parts = self.io.gather(ids)  # copies: the blocks can be freed at once
        finally:
            self.leases.release(lease.blocks)
        if self.name == "tcp":
            return [_encoder.encode(Reply(True)), *(p.numpy() for p in parts)]
        path = os.path.join(SHM_DIR, SHM_PREFIX + uuid.uuid4().hex)
        with open(path, "wb") as f:
            for p in parts:
                f.write(p.numpy().data)
        self._shm_files[path] = time.monotonic()
        return [_encoder.encode(Reply(True, path=path, sizes=[p.numel() for p in parts]))]

    def _remove_stale_shm(self) -> None:
        """Payload files a consumer never read (it died): removed after the lease time."""
        now = time.monotonic()
        for path, t in list(self._shm_files.items()):
            if not os.path.exists(path):
                del self._shm_files[path]
            elif now - t > self.config.lease_s:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                del self._shm_files[path]

    def shutdown(self) -> None:
        self._stop.set()
        super().shutdown()
