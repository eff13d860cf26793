"""`--kv-transfer-config`: vLLM's JSON shape, checked here so a bad value is refused at
start with the key that is wrong."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields

from kvserve.kv_transfer.peers import THIS_HOST, Peer, parse_peer

CONNECTORS = ("tcp", "shm", "disk")
ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_host: str = "127.0.0.1"  # tcp / shm: where this engine serves its leased blocks
    kv_port: int = 0  # 0: any free port (reported in each request's kv_transfer_params)
    kv_path: str | None = None  # disk: the shared directory
    lease_s: float = 30.0  # a producer frees blocks nobody pulled after this long
    transfer_timeout_s: float = 5.0  # a consumer gives up on a silent producer after this long
    engine_id: str | None = None  # names this engine in kv_transfer_params (default: random)
    kv_producers: tuple[str, ...] = THIS_HOST  # tcp / shm: whom a consumer pulls from (peers.py)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @functools.cached_property
    def producer_peers(self) -> tuple[Peer, ...]:
        return tuple(parse_peer(e) for e in self.kv_producers)


def _fail(key: str, why: str) -> None:
    raise ValueError(f"kv_transfer_config: {key}: {why}")


def parse_kv_transfer_config(value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
    """The config from the flag's JSON text (or a dict); ValueError names the bad key."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config: not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_config: must be a JSON object")
    known = {f.name for f in fields(KVTransferConfig)}
    for key in value:
        if key not in known:
            _fail(key, f"unknown key (known: {', '.join(sorted(known))})")
    for key in ("kv_connector", "kv_role"):
        if key not in value:
            _fail(key, "required")
    if value["kv_connector"] not in CONNECTORS:
        _fail("kv_connector", f"{value['kv_connector']!r} is not one of {', '.join(CONNECTORS)}")
    if value["kv_role"] not in ROLES:
        _fail("kv_role", f"{value['kv_role']!r} is not one of {', '.join(ROLES)}")
    for key in ("kv_host", "kv_path", "engine_id"):
        if key in value and value[key] is not None and not isinstance(value[key], str):
            _fail(key, "must be a string")
    port = value.get("kv_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        _fail("kv_port", f"must be an integer in [0, 65535], got {port!r}")
    for key in ("lease_s", "transfer_timeout_s"):
        v = value.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
            _fail(key, f"must be a number of seconds in (0, 3600], got {v!r}")
    producers = value.get("kv_producers", list(THIS_HOST))
    if not isinstance(producers, list):
        _fail("kv_producers", 'must be a list of hosts, "host:port"s or networks (CIDR)')
    for entry in producers:
        try:
            parse_peer(entry)
        except ValueError as e:
            _fail("kv_producers", str(e))
    value = {**value, "kv_producers": tuple(producers)}
    if value["kv_connector"] == "disk" and not value.get("kv_path"):
        _fail("kv_path", "required with kv_connector 'disk' (the directory both engines share)")
    return KVTransferConfig(**value)
