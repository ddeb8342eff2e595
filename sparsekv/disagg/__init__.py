"""Prefill/decode disaggregation (docs/disaggregation.md): a server's prefill or decode role
(worker.py, prefill.py, decode.py, roles.py), what the two say to each other (wire.py), how the KV
moves (transfer.py: a bootstrap store and a gloo or NCCL pair per request), which weights computed
it (weights_stamp.py), and the router in front (router*.py)."""
