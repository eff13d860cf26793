"""Prefill/decode disaggregation: moving a prompt's KV blocks from one engine to another.

A *producer* engine runs a prompt (the proxy asks for one token), keeps the request's blocks
under a lease instead of freeing them, and answers with `kv_transfer_params` naming where
they are. A *consumer* engine given those parameters does not compute the prompt: the
request waits in WAITING_FOR_REMOTE_KV while its blocks are pulled, then decodes from the
last prompt token on. Anything that goes wrong on the way (a dead or silent producer, an
expired lease, a mismatched layout or prompt) makes the consumer compute the prompt itself:
slower, never wrong, never stuck.

  config.py      --kv-transfer-config (connector, role, addresses, timeouts)
  peers.py       kv_producers: the only producers a consumer connects to (not the client's pick)
  params.py      the per-request kv_transfer_params, both directions
  block_io.py    a rank's KV blocks as flat tensors and back (layout checked on both sides)
  leases.py      the producer's held blocks, each with an expiry
  connector.py   the interface the scheduler and the engine core call; factory.py picks one
  zmq_connector.py   `tcp` (blocks as raw ZeroMQ frames) and `shm` (through /dev/shm files)
  disk_connector.py  `disk`: a shared directory of hash-named blocks (also an offload tier)
"""
