"""The KV pages each tenant's running requests take: the ledger behind the scheduler's tenant shares.
Plain Python, no torch.

With reserving admission a running request takes its footprint, the pages of prompt + max_tokens, from
its admission to its end (`reserved`); with optimistic admission, the pages it holds plus those still
reserved for it (`held`)."""
from __future__ import annotations

from .pages import PageAllocator


class TenantPages:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.reserved: dict[str, int] = {}  # tenant -> footprints of its running requests

    def footprint(self, req) -> int:
        return self.allocator.pages_for(req.max_total_tokens)

    def admit(self, req) -> None:
        self.reserved[req.tenant] = self.reserved.get(req.tenant, 0) + self.footprint(req)

    def release(self, req) -> None:
        left = self.reserved[req.tenant] - self.footprint(req)
        if left:
            self.reserved[req.tenant] = left
        else:
            del self.reserved[req.tenant]

    def held(self, running) -> dict[str, int]:
        """Pages each tenant's running requests hold or have reserved, a page that several of them share
        (a prefix hit, the choices of n > 1) counted once. Shared pages lead a request's page table (a
        hit is a prompt's first pages), so only requests whose first page is shared are merged as sets."""
        held: dict[str, int] = {}
        shared: dict[str, set[int]] = {}
        for r in running:
            held[r.tenant] = held.get(r.tenant, 0) + self.allocator.reserved(r.request_id)
            if r.page_ids and self.allocator.num_owners(r.page_ids[0]) > 1:
                shared.setdefault(r.tenant, set()).update(r.page_ids)
            else:
                held[r.tenant] += len(r.page_ids)
        for tenant, pages in shared.items():
            held[tenant] += len(pages)
        return held

    def stats(self, running, waiting, optimistic: bool) -> dict[str, dict[str, int]]:
        """Per tenant: running and waiting requests, and the KV pages its running requests reserve (prompt +
        max_tokens; with optimistic admission, the pages they hold or have reserved)."""
        out: dict[str, dict[str, int]] = {}
        for state, reqs in (("running", running), ("waiting", waiting)):
            for req in reqs:
                out.setdefault(req.tenant, {"running": 0, "waiting": 0, "kv_pages": 0})[state] += 1
        for tenant, pages in (self.held(running) if optimistic else self.reserved).items():
            out[tenant]["kv_pages"] = pages
        return out

    def check_integrity(self, running, cap: int | None) -> None:
        """`cap`: the most pages a tenant may reserve (None: no cap)."""
        reserved: dict[str, int] = {}
        for req in running:
            reserved[req.tenant] = reserved.get(req.tenant, 0) + self.footprint(req)
        assert reserved == self.reserved, "the pages reserved per tenant disagree with the running requests"
        assert cap is None or all(n <= cap for n in reserved.values()), \
            "a tenant holds more than its share of the KV cache"
