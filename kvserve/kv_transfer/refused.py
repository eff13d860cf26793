"""A lease for a request the consumer refuses: released at once.

A consumer's input processor (in the API process) refuses a request that cannot run here, e.g.
its prompt + max_tokens past this engine's context, before the engine core and its connector
ever see it; the producer that prefilled it would hold the prompt's blocks until the lease
expired. The processor hands such a request's parameters here instead.
"""

from __future__ import annotations

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.params import check_kv_transfer_params, remote_prefill
from kvserve.kv_transfer.peers import allowed

PULLED = ("tcp", "shm")  # the connectors whose producer holds a lease until told (disk's never waits)


def release_refused(config: KVTransferConfig | None, params: dict | None) -> None:
    """Tell the producer named by a refused request's kv_transfer_params to free its lease, if
    they are valid parameters this consumer would have pulled with (never anywhere else)."""
    if config is None or not config.is_consumer:
        return
    try:
        rp = remote_prefill(check_kv_transfer_params(params))
    except ValueError:
        return
    if rp is None or rp.connector not in PULLED or not allowed(config.producer_peers, rp.host, rp.port):
        return
    from kvserve.kv_transfer.zmq_connector import send_release  # zmq only where it is needed

    send_release(rp, config.transfer_timeout_s)


def same_lease(params: dict | None, held: dict | None) -> bool:
    """Whether two requests' kv_transfer_params name one lease (a resent body): the live one
    pulls it, so refusing the other must not release it."""
    if not isinstance(params, dict) or not isinstance(held, dict):
        return False
    handle = params.get("remote_request_id")
    return handle is not None and handle == held.get("remote_request_id")
