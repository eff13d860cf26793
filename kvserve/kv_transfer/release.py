"""A lease's release message, sendable from any process: a consumer's API process, and the
fronts (pd-proxy, a gateway pd deployment) whose request will not reach a decode engine.

Kept apart from zmq_connector.py so a front does not import torch to free a producer's
blocks (msgspec and ZeroMQ only)."""

from __future__ import annotations

import logging

import msgspec
import zmq

from kvserve.kv_transfer.params import RemotePrefill, check_kv_transfer_params, remote_prefill

logger = logging.getLogger(__name__)
PULLED = ("tcp", "shm")  # the connectors whose producer holds a lease until told (disk's never waits)
_encoder = msgspec.msgpack.Encoder()


class Release(msgspec.Struct, tag=True):
    handle: str


def send_release(rp: RemotePrefill, linger_s: float) -> None:
    """Release a lease from a process without a connector (the caller checked the peer): the
    message is queued at once and sent in ZeroMQ's I/O thread for up to `linger_s`."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        sock.connect(f"tcp://{rp.host}:{rp.port}")
        sock.send(_encoder.encode(Release(rp.request_id)), zmq.NOBLOCK)
    except zmq.ZMQError as e:
        logger.warning("kv transfer: could not release lease %s (%s)", rp.request_id, e)
    finally:
        sock.close()


def pulled_lease(params: dict | None) -> RemotePrefill | None:
    """The lease a producer holds for these parameters until told, if any (None: malformed
    ones, no lease, or a `disk` one that never waits)."""
    try:
        rp = remote_prefill(check_kv_transfer_params(params))
    except ValueError:
        return None
    return rp if rp is not None and rp.connector in PULLED else None
