"""Move tensors through the weight table: HF checkpoint dir -> KimiK3 tensors, KimiK3 state -> HF tensors.

Import streams the HF shards (safetensors_io.iter_tensors) and hands each KimiK3 tensor to a sink as
soon as all of its HF parts have arrived, then drops the parts: at most one layer's experts are
pending at a time (they sit in one shard or in consecutive ones), never the whole model twice.
Every tensor name must be accounted for both ways, and every assembled tensor must have the shape
KimiK3 expects; anything else is an error naming the tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from kimik3.hf.safetensors_io import iter_tensors, tensor_names
from kimik3.hf.weight_map import Rule, canonical_hf_name


def stream_from_hf(
    rules: Sequence[Rule],
    hf_dir: str | Path,
    shapes: Mapping[str, Sequence[int]],
    sink: Callable[[str, torch.Tensor], None],
) -> None:
    """Call sink(our_name, tensor) once per rule, reading `hf_dir` shard by shard.

    shapes: the KimiK3 shape of every rule's tensor (from the model's state_dict, on any device).
    """
    owner: dict[str, Rule] = {}
    for rule in rules:
        for name in rule.hf_names():
            owner[name] = rule
    on_disk = [canonical_hf_name(n) for n in tensor_names(hf_dir)]
    unmapped = sorted(set(on_disk) - set(owner))
    missing = sorted(set(owner) - set(on_disk))
    if unmapped:
        raise ValueError(f"{hf_dir}: HF tensors with no KimiK3 counterpart: {unmapped[:8]}"
                         f"{' ...' if len(unmapped) > 8 else ''}")
    if missing:
        raise ValueError(f"{hf_dir}: HF tensors missing from the checkpoint: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")

    pending: dict[str, dict[str, torch.Tensor]] = {}  # our name -> HF parts received so far
    for raw_name, tensor in iter_tensors(hf_dir):
        rule = owner[canonical_hf_name(raw_name)]
        parts = pending.setdefault(rule.ours, {})
        parts[canonical_hf_name(raw_name)] = tensor
        if len(parts) == len(rule.hf_names()):
            sink(rule.ours, rule.to_ours(pending.pop(rule.ours), shapes[rule.ours]))


def hf_tensors(rules: Sequence[Rule], state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of KimiK3 `state`, in table order."""
    for rule in rules:
        yield from rule.to_hf(state[rule.ours])
