"""`disk`: a shared directory of KV blocks named by their prefix-cache hash.

A producer writes each full block of a finished request (those not on disk already) as one
file, `<kv_path>/<layout>/<block hash>`, written to a temporary name and renamed, so a reader
never sees half a block; its blocks stay leased until written. A consumer looks for the
files of its prompt's blocks after the local prefix-cache hits. Under prefill/decode
disaggregation it waits (up to `transfer_timeout_s`) for the blocks the producer announced;
with `kv_both` every finished request is written and every request looks on disk, so the
directory is a KV offload tier that outlives the engine (nothing is evicted from it: size
it with the filesystem). Only full blocks go to disk; a consumer computes the partial last
block's tokens itself.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import numpy as np

from kvserve.core.block_pool import hash_prompt_blocks
from kvserve.kv_transfer.block_io import KVBlockIO
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.connector import KVConnector
from kvserve.kv_transfer.params import prompt_digest, remote_prefill, wants_remote_decode
from kvserve.request import Request

logger = logging.getLogger(__name__)
POLL_S = 0.005  # how often a waiting consumer looks for announced files


class DiskConnector(KVConnector):
    name = "disk"

    def __init__(self, config: KVTransferConfig, io: KVBlockIO, block_size: int) -> None:
        super().__init__(config, io, block_size)
        self.dir = os.path.join(config.kv_path, io.layout)
        os.makedirs(self.dir, exist_ok=True)
        logger.info("kv transfer (disk): blocks under %s", self.dir)

    def _path(self, h: bytes) -> str:
        return os.path.join(self.dir, h.hex())

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        return hash_prompt_blocks(req.all_token_ids[:num_tokens], self.block_size, req.cache_salt)

    # ---- producer ---------------------------------------------------------------------------
    def request_finished(self, req: Request, blocks: list[int]) -> tuple[bool, dict | None]:
        remote = wants_remote_decode(req.params.kv_transfer_params)
        if not self.config.is_producer or not (remote or self.config.kv_role == "kv_both"):
            return False, None
        hashes = self._hashes(req, req.num_computed_tokens)
        todo = [(b, h) for b, h in zip(blocks, hashes) if not os.path.exists(self._path(h))]
        handle = uuid.uuid4().hex
        if todo:
            self.leases.add(handle, blocks, req.num_computed_tokens, "")
            self._pool.submit(self._write, handle, todo)
        params = None
        n = req.num_prompt_tokens - 1
        if remote and n >= 1:
            params = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_request_id": handle, "remote_num_tokens": n,
                "prompt_digest": prompt_digest(req.prompt_token_ids[:n]), "kv_connector": self.name,
            }  # fmt: skip
        return bool(todo), params

    def _write(self, handle: str, todo: list[tuple[int, bytes]]) -> None:
        lease = self.leases.take(handle)
        if lease is None:
            return  # expired before the writer got to it
        try:
            parts = self.io.gather([b for b, _ in todo])
        finally:
            self.leases.release(lease.blocks)
        sizes = self.io.block_bytes()
        for i, (_, h) in enumerate(todo):
            tmp = os.path.join(self.dir, f".{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    for part, size in zip(parts, sizes):
                        f.write(part[i * size : (i + 1) * size].numpy().data)
                os.replace(tmp, self._path(h))
            except OSError as e:
                logger.warning("kv transfer (disk): could not write a block (%s)", e)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    # ---- consumer ---------------------------------------------------------------------------
    def num_remote_tokens(self, req: Request, num_local_tokens: int) -> int:
        if not self.config.is_consumer or req.params.prompt_logprobs is not None or req.params.pooling:
            return 0
        bs = self.block_size
        rp = remote_prefill(req.params.kv_transfer_params)
        if rp is not None:  # announced: wait for them (start_load) if the prompt is the producer's
            n = rp.num_tokens
            if n > req.num_prompt_tokens - 1 or prompt_digest(req.prompt_token_ids[:n]) != rp.digest:
                logger.warning("kv transfer: %s's prompt is not the producer's; computing it here",
                               req.request_id)  # fmt: skip
                return 0
            return max(0, (n // bs) * bs - num_local_tokens)
        hashes = self._hashes(req, req.num_prompt_tokens - 1)
        found = num_local_tokens // bs
        while found < len(hashes) and os.path.exists(self._path(hashes[found])):
            found += 1
        return max(0, found * bs - num_local_tokens)

    def _fetch(self, req: Request, first_block: int, num_blocks: int) -> list:
        hashes = self._hashes(req, (first_block + num_blocks) * self.block_size)[first_block:]
        deadline = time.monotonic() + self.config.transfer_timeout_s
        sizes = self.io.block_bytes()
        blocks = []
        for h in hashes:
            path = self._path(h)
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"block {h.hex()[:12]} not on disk after {self.config.transfer_timeout_s}s"
                    )
                time.sleep(POLL_S)
            data = np.fromfile(path, dtype=np.uint8)
            if len(data) != sum(sizes):
                raise RuntimeError(f"{path}: {len(data)} bytes, expected {sum(sizes)}")
            blocks.append(data)
        bounds = np.cumsum([0, *sizes])
        return [np.concatenate([b[bounds[i] : bounds[i + 1]] for b in blocks]) for i in range(len(sizes))]
