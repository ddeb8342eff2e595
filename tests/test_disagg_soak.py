"""Random concurrent clients through the PD router to a real prefill and a real decode worker (the
clients of tests/test_server_soak.py: streams cut after a few chunks, clients that give up, /abort_request
by id, several choices, chat and text): every room ends on both sides, the prefill worker's store keeps
no key, neither engine keeps a request and both pools' integrity holds, and every request that ran to
its end was answered whole. Rooms of one pair reuse the store connections earlier rooms gave back
(transfer.StoreClients), cut off at every stage of a room here."""
from __future__ import annotations

import pytest
import torch

from test_disagg_router import routed_pair
from test_server_soak import answered_whole, check_answers, run_clients, _ended_whole
from test_server_util import tiny_checkpoint, wait_until


@pytest.mark.parametrize("seed", [0, 1])
def test_random_clients_through_the_router_leave_no_room_and_no_request(tmp_path, seed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_checkpoint(tmp_path)
    try:
        with routed_pair(model, max_model_len=256, kv_page_size=16, max_num_seqs=4, num_threads=1,
                         timeout_s=20.0) as (url, p, d):
            ended = _ended_whole(d.url)
            outcomes = run_clients(url, seed, 16)
            for worker in (p, d):
                assert wait_until(lambda: worker.worker.rooms == {}, 30), worker.worker.rooms
                worker.check_clean()
            assert wait_until(lambda: p.worker.store.num_keys() == 0, 10)
            check_answers(outcomes)
            whole, _, _ = answered_whole(outcomes)
            assert _ended_whole(d.url) - ended == whole  # the decode worker answers each choice
    finally:
        torch.set_num_threads(threads)
