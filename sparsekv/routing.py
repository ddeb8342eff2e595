"""Routed experts of the sampled rows (`return_routed_experts`): what a trainer needs to replay the
routing the engine used.

The recorder hooks the router of every MoE layer of the main model (`MoE.record`; never the MTP
layer's, whose passes only draft). While on, each call's expert ids are kept, in layer order and, within
a layer, in call order, which is the flat batch's row order. After the step it keeps only the rows the
step samples from (the runner's `logits_rows`: the last known token's row of each sampling chunk,
then one per draft), as one [rows, MoE layers, top-k] tensor on the host, each row's ids ascending.
"""
from __future__ import annotations

import torch


class RoutedExpertsRecorder:
    def __init__(self, model):
        self.moe_layers = [i for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "route")]
        self._calls: dict[int, list[torch.Tensor]] = {}
        self.on = False
        for i in self.moe_layers:
            model.layers[i].ffn.record = self._recorder(i)

    def _recorder(self, layer: int):
        def record(ids: torch.Tensor) -> None:
            if self.on:
                self._calls.setdefault(layer, []).append(ids)
        return record

    def begin(self, on: bool) -> None:
        self.on, self._calls = on and bool(self.moe_layers), {}

    def take(self, chunks) -> torch.Tensor | None:
        """[sampled rows, MoE layers, top-k] int32 expert ids of this step's sampling rows, or None if off."""
        if not self.on:
            return None
        self.on = False
        rows = torch.tensor(sampling_rows(chunks), dtype=torch.long)
        per_layer = [torch.cat(self._calls[i]).cpu()[rows] for i in self.moe_layers]
        self._calls = {}
        return torch.stack(per_layer, dim=1).sort(dim=-1).values.to(torch.int32)  # ascending ids per layer


def sampling_rows(chunks) -> list[int]:
    """The flat batch's rows whose logits sample, in order (as the runner picks them)."""
    rows, row = [], 0
    for ch in chunks:
        row += ch.num_new_tokens
        if ch.samples_token:
            rows.extend(range(row - 1 - ch.num_draft_tokens, row))
    return rows
