"""A front's lease it will not hand to a decode engine, released at once (pd-proxy and the
gateway's pd deployments).

A producer keeps a prefilled prompt's blocks until a consumer pulls them or releases them; a
request that never reaches a consumer (the client left after the prefill, every decode engine
failed or was busy, a decode engine refused the parameters) held them until `lease_s`, blocks
nobody could use (kvserve:kv_leases_expired). The front made the parameters itself from its
own prefill engine's answer, so it may tell that producer."""

from __future__ import annotations

from kvserve.kv_transfer.release import pulled_lease, send_release

LINGER_S = 2.0  # how long ZeroMQ's I/O thread tries to deliver the release (never blocks the caller)


def release_lease(params: dict | None) -> bool:
    """Release the lease `params` name, if a producer holds one until told; whether one was
    sent. A consumer that already pulled it makes this a no-op at the producer."""
    rp = pulled_lease(params)
    if rp is None or not rp.host or not rp.port:
        return False
    send_release(rp, LINGER_S)
    return True
