"""The routed-experts recorder (sparsekv/routing.py) on a stand-in model: which rows it keeps and how it
lays them out, without running an engine (tests/test_rl_engine.py checks the ids against the router)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from sparsekv.routing import RoutedExpertsRecorder, sampling_rows


def chunk(new, samples, drafts=0):
    return SimpleNamespace(num_new_tokens=new, samples_token=samples, num_draft_tokens=drafts)


def test_sampling_rows_are_each_sampling_chunks_last_token_and_its_drafts():
    # rows 0-4: a prompt's last chunk (samples from row 4); 5-8: a prefill chunk that does not sample;
    # 9-11: a decode with 2 drafts (samples from its known token's row 9 and each draft's, 10 and 11)
    chunks = [chunk(5, True), chunk(4, False), chunk(3, True, drafts=2), chunk(1, True)]
    assert sampling_rows(chunks) == [4, 9, 10, 11, 12]
    assert sampling_rows([chunk(4, False)]) == []


def _model(kinds):
    """Layers whose ffn has a router (`route`) for "moe", none for "dense"."""
    ffn = lambda kind: SimpleNamespace(route=object()) if kind == "moe" else SimpleNamespace()  # noqa: E731
    return SimpleNamespace(layers=[SimpleNamespace(ffn=ffn(k)) for k in kinds])


def test_recorder_keeps_the_sampled_rows_of_every_moe_layer_in_ascending_order():
    model = _model(["dense", "moe", "moe"])
    rec = RoutedExpertsRecorder(model)
    assert rec.moe_layers == [1, 2]
    rec.begin(True)
    # the step's 3 rows in two calls per layer (row order), top-2 ids unsorted
    model.layers[1].ffn.record(torch.tensor([[3, 1], [0, 2]]))
    model.layers[1].ffn.record(torch.tensor([[7, 5]]))
    model.layers[2].ffn.record(torch.tensor([[6, 4], [1, 0], [2, 3]]))
    got = rec.take([chunk(2, True), chunk(1, True)])       # rows 1 and 2 sample
    assert got.dtype == torch.int32 and got.tolist() == [[[0, 2], [0, 1]], [[5, 7], [2, 3]]]
    assert rec.take([chunk(1, True)]) is None                # one step only: off until begun again


def test_recorder_off_or_without_moe_layers_records_nothing():
    model = _model(["dense", "moe"])
    rec = RoutedExpertsRecorder(model)
    rec.begin(False)
    model.layers[1].ffn.record(torch.tensor([[1, 0]]))
    assert rec.take([chunk(1, True)]) is None
    dense_only = RoutedExpertsRecorder(_model(["dense"]))
    dense_only.begin(True)
    assert dense_only.take([chunk(1, True)]) is None
