"""Prefill/decode disaggregation (docs/disaggregation.md): a server's prefill or decode role
(worker.py, prefill.py, decode.py, roles.py), what the two say to each other (wire.py), how the KV
moves (transfer.py: a bootstrap store and a gloo pair per request), and the router in front
(router*.py)."""
