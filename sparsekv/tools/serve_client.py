"""What every `sparsekv bench serve` workload asks a server first."""
from __future__ import annotations

import httpx


async def server_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, int]:
    """(the model to request: `model`, else the server's first; its vocabulary size, for random prompts)."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    first = r.json()["data"][0]
    return model or first["id"], int(first.get("vocab_size") or 256)
