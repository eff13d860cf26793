"""A rank's KV blocks as flat byte tensors and back: what a connector sends and receives.

A block's payload is its slice of every KV tensor the rank keeps (the cache, and the scales
of a 1-byte cache), all layers, keys and values. `layout` names everything that must match
for another engine's bytes to mean the same thing here (model, dtypes, heads, block size);
a consumer refuses a payload of another layout and computes the prompt itself.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence

import torch


class KVBlockIO:
    def __init__(self, tensors: Sequence[torch.Tensor], identity: str) -> None:
        self.tensors = list(tensors)  # each [layers, 2, num_blocks, ...]
        shapes = ";".join(f"{t.dtype}{list(t.shape[:2]) + list(t.shape[3:])}" for t in self.tensors)
        self.layout = hashlib.sha256(f"{identity}|{shapes}".encode()).hexdigest()[:24]

    @classmethod
    def from_runner(cls, runner, identity: str) -> KVBlockIO:
        return cls([t for t in (runner.kv_cache, runner.kv_scales) if t is not None], identity)

    def block_bytes(self) -> list[int]:
        """Bytes of one block in each tensor."""
        return [t[:, :, 0].numel() * t.element_size() for t in self.tensors]

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Copies of these blocks, one flat uint8 tensor per KV tensor, block after block (so
        block i is bytes [i * size, (i + 1) * size) of each part); safe to send after the blocks
        are freed: nothing here points into the pool."""
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        return [t.movedim(2, 0)[idx].view(-1).view(torch.uint8) for t in self.tensors]  # one copy each

    def scatter(self, block_ids: Sequence[int], payload: Sequence) -> None:
        """Write received blocks (one bytes-like per KV tensor, as `gather` made them)."""
        if len(payload) != len(self.tensors):
            raise ValueError(f"payload: {len(payload)} parts for {len(self.tensors)} KV tensors")
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        for t, part, per_block in zip(self.tensors, payload, self.block_bytes()):
            with warnings.catch_warnings():  # read-only buffers (ZeroMQ frames) are only read
                warnings.simplefilter("ignore", UserWarning)
                flat = part if isinstance(part, torch.Tensor) else torch.frombuffer(part, dtype=torch.uint8)
            if flat.numel() != per_block * len(idx):
                raise ValueError(f"payload: {flat.numel()} bytes for {len(idx)} blocks of {per_block}")
            shape = (len(idx), t.shape[0], t.shape[1], *t.shape[3:])
            t[:, :, idx] = flat.view(t.dtype).view(shape).movedim(0, 2)
