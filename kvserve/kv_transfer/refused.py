"""A lease for a request the consumer refuses: released at once.

A consumer's input processor (in the API process) refuses a request that cannot run here, e.g.
its prompt + max_tokens past this engine's context, before the engine core and its connector
ever see it; the producer that prefilled it would hold the prompt's blocks until the lease
expired. The processor hands such a request's parameters here instead.
"""

from __future__ import annotations

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.peers import allowed
from kvserve.kv_transfer.release import pulled_lease, send_release


def release_refused(config: KVTransferConfig | None, params: dict | None) -> None:
    """Tell the producer named by a refused request's kv_transfer_params to free its lease, if
    they are valid parameters this consumer would have pulled with (never anywhere else)."""
    if config is None or not config.is_consumer:
        return
    rp = pulled_lease(params)
    if rp is None or not allowed(config.producer_peers, rp.host, rp.port):
        return
    send_release(rp, config.transfer_timeout_s)


def same_lease(params: dict | None, held: dict | None) -> bool:
    """Whether two requests' kv_transfer_params name one lease (a resent body): the live one
    pulls it, so refusing the other must not release it."""
    if not isinstance(params, dict) or not isinstance(held, dict):
        return False
    handle = params.get("remote_request_id")
    return handle is not None and handle == held.get("remote_request_id")
