"""Files and batch ids as the gateway hands them out: the backend's id with the deployment that
holds it and a tag of the key that made it.

A file and the batch reading it live on one backend, so every later call (batches.create,
retrieve, cancel, files.content) must reach that deployment; the id carries it, as Responses
ids do (routing/responses_ids.py), so no shared table can lose it and every gateway instance
with the same model_list decodes it. The owner tag (a hash of the key's hash) keeps one key's
files and batches from another key that learned an id: a backend's ids are its own to every
caller. `file-` / `batch_` + base64url of `kvgw1:<len>:<deployment id><owner tag><backend id>`."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from kvserve.routing.responses_ids import unwrap_id, wrap_id

_OWNER_LEN = 16
FILE, BATCH = "file-", "batch_"


class Held(NamedTuple):
    """What a gateway id names."""

    deployment: str
    owner: str
    backend_id: str


def owner_tag(key_hash: str) -> str:
    """A key's tag in its ids: not its hash (which an id would then disclose)."""
    return hashlib.sha256(f"kvgw-owner:{key_hash}".encode()).hexdigest()[:_OWNER_LEN]


def encode(prefix: str, dep_id: str, owner: str, backend_id: str) -> str:
    return wrap_id(prefix, dep_id, owner + backend_id)


def decode(prefix: str, public_id: object) -> Held | None:
    """What the id names, or None for an id the gateway did not hand out (or of another kind)."""
    held = unwrap_id(prefix, public_id)
    if held is None or not held[0] or len(held[1]) <= _OWNER_LEN:
        return None
    dep_id, rest = held
    return Held(dep_id, rest[:_OWNER_LEN], rest[_OWNER_LEN:])
