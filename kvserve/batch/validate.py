"""The validating pass over a batch input: count its lines, find repeated `custom_id`s and the
model the lines name.

OpenAI requires every `custom_id` to be unique within a batch and fails a batch whose file
repeats one (status `failed`, `errors.data[]` with code `duplicate_custom_id` and the line),
because the output is matched to the input by that id alone. The file is read one line at a
time and only an 8-byte hash per id is kept (in a bytearray, sorted once with numpy: about
8 bytes a line, not a Python set's ~70), so a 100,000-line file costs under 1 MB. Hash
matches are then confirmed by a second pass that compares the ids themselves, so a hash
collision can never fail a batch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAX_REPORTED = 100  # errors.data entries at most; the message says how many there were


@dataclass
class Scan:
    total: int = 0  # non-blank lines
    duplicates: list[tuple[int, int, str]] = field(default_factory=list)  # (line, first line, id), 1-based
    num_duplicates: int = 0
    model: str | None = None  # the first `body.model` a line names (the Batch object's `model`)


def _line(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def custom_id_of(raw: bytes) -> str | None:
    """The line's custom_id if it has one; a line that has none becomes an error line later."""
    cid = (_line(raw) or {}).get("custom_id")
    return cid if isinstance(cid, str) and cid else None


def model_of(obj: dict) -> str | None:
    body = obj.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def _digest(cid: str) -> bytes:
    # surrogatepass: a lone surrogate ("\ud800" is valid JSON) hashes too; its line is refused later
    return hashlib.blake2b(cid.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def scan_input(path: str | Path) -> Scan:
    """Count non-blank lines and report repeated custom_ids (each repeat after the first)."""
    scan = Scan()
    hashes = bytearray()
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            scan.total += 1
            obj = _line(raw) or {}
            if scan.model is None:
                scan.model = model_of(obj)
            cid = obj.get("custom_id")
            if isinstance(cid, str) and cid:
                hashes += _digest(cid)
    arr = np.sort(np.frombuffer(hashes, dtype=np.uint64))
    repeated = arr[1:][arr[1:] == arr[:-1]]
    if repeated.size == 0:
        return scan
    suspects = {repeated[i : i + 1].tobytes() for i in range(repeated.size)}
    del arr, repeated, hashes
    first: dict[str, int] = {}  # only ids whose hash repeats: small unless the file is mostly repeats
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            cid = custom_id_of(raw) if raw.strip() else None
            if cid is None or _digest(cid) not in suspects:
                continue
            if cid in first:
                scan.num_duplicates += 1
                if len(scan.duplicates) < MAX_REPORTED:
                    scan.duplicates.append((lineno, first[cid], cid))
            else:
                first[cid] = lineno
    return scan


def duplicate_errors(scan: Scan) -> dict:
    """OpenAI's `errors` object for a batch failed on repeated custom_ids."""
    data = [
        {
            "code": "duplicate_custom_id",
            "message": f"custom_id {cid!r} on line {line} repeats line {first}: the custom_id "
            "parameter must be unique for each request in a batch",
            "param": "custom_id",
            "line": line,
        }
        for line, first, cid in scan.duplicates
    ]
    if scan.num_duplicates > len(data):
        data[-1]["message"] += f" ({scan.num_duplicates} repeated lines in all; the first {len(data)} listed)"
    return {"object": "list", "data": data}
