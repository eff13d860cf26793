"""The connector a --kv-transfer-config names."""

from __future__ import annotations

from kvserve.kv_transfer.block_io import KVBlockIO
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.connector import KVConnector


def make_connector(config: KVTransferConfig, io: KVBlockIO, block_size: int) -> KVConnector:
    if config.kv_connector == "disk":
        from kvserve.kv_transfer.disk_connector import DiskConnector

        return DiskConnector(config, io, block_size)
    from kvserve.kv_transfer.zmq_connector import ZmqConnector

    return ZmqConnector(config, io, block_size)
