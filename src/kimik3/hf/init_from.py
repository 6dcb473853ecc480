"""`model.init_from`: start a KimiK3 from a transformers Kimi Linear dir or a kimik3 checkpoint.

Three kinds of source, told apart by what the path holds:
    HF dir            config.json (model_type kimi_linear) + safetensors shards      -> hf/weight_map table
    kimik3 weights    kimik3.json + safetensors in KimiK3 names (`kimik3-convert import` writes it)
    kimik3 checkpoint a trainer checkpoint (.pt file or a torchrun run's DCP dir), or a run dir (its latest)
The architecture recorded in the source must equal the one being trained (`check_same_architecture`,
one line listing every differing field); then the weights are copied into the built model in place,
streamed, so the trainer calls this after build_model and before the optimizer exists.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kimik3.config.schema import ModelConfig
from kimik3.hf.config_map import check_same_architecture, config_from_hf_dir, read_json
from kimik3.hf.safetensors_io import iter_tensors
from kimik3.hf.transfer import stream_from_hf
from kimik3.hf.weight_map import check_complete, rules_for

KIMIK3_META = "kimik3.json"
KIMIK3_FORMAT = 1


def write_kimik3_meta(cfg: ModelConfig, vocab_size: int, source: str) -> str:
    """Text of kimik3.json: the ModelConfig a kimik3 weights dir was made with."""
    meta = {"format": KIMIK3_FORMAT, "model": dataclasses.asdict(cfg), "vocab_size": vocab_size, "source": source}
    return json.dumps(meta, indent=2) + "\n"


def read_kimik3_meta(weights_dir: str | Path) -> tuple[ModelConfig, int]:
    """(ModelConfig, vocab_size) recorded in a kimik3 weights dir."""
    meta = read_json(Path(weights_dir) / KIMIK3_META)
    if meta.get("format") != KIMIK3_FORMAT:
        raise ValueError(f"{weights_dir}/{KIMIK3_META} has format {meta.get('format')!r}, expected {KIMIK3_FORMAT}")
    return ModelConfig(**meta["model"]), int(meta["vocab_size"])


def source_kind(path: str | Path, name: str = "model.init_from") -> str:
    """'hf', 'kimik3_weights' or 'checkpoint' for a weights source (FileNotFoundError naming it as
    `name` if absent)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{name}={str(path)!r} does not exist")
    if (path / KIMIK3_META).is_file():
        return "kimik3_weights"
    if (path / "config.json").is_file():
        return "hf"
    return "checkpoint"


def _state_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items()}


def _copy_into(model: torch.nn.Module) -> tuple[Callable[[str, torch.Tensor], None], set[str]]:
    """A sink that copies a named tensor into the model's state in place, and the set it fills."""
    targets = model.state_dict(keep_vars=True)
    done: set[str] = set()

    def sink(name: str, tensor: torch.Tensor) -> None:
        target = targets[name]
        if tensor.shape != target.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        done.add(name)

    return sink, done


def load_initial_weights(model: torch.nn.Module, cfg: ModelConfig, path: str | Path) -> dict[str, Any]:
    """Check `path`'s architecture against `cfg` and copy its weights into `model` (in place).

    Returns a small summary for the run log: {"init_from", "kind", "tensors"}.
    """
    shapes = _state_shapes(model)
    vocab_size = int(shapes["embed.weight"][0])
    kind = source_kind(path)
    source = f"model.init_from={str(path)!r}"
    sink, done = _copy_into(model)
    if kind == "hf":
        check_same_architecture(cfg, config_from_hf_dir(path), vocab_size=vocab_size, source=source)
        rules = rules_for(cfg)
        check_complete(rules, shapes)
        stream_from_hf(rules, path, shapes, sink)
    else:
        if kind == "kimik3_weights":
            theirs, their_vocab = read_kimik3_meta(path)
            tensors = iter_tensors(path)
        else:
            theirs, their_vocab, tensors = read_trainer_checkpoint(path)
        check_same_architecture(cfg, dataclasses.replace(theirs, vocab_size=their_vocab),
                                vocab_size=vocab_size, source=source)
        for name, tensor in tensors:
            if name not in shapes:
                raise ValueError(f"{source}: tensor {name!r} is not in the model")
            sink(name, tensor)
    missing = sorted(set(shapes) - done)
    if missing:
        raise ValueError(f"{source}: no value for model tensors {missing[:8]}")
    return {"init_from": str(path), "kind": kind, "tensors": len(done)}


def read_trainer_checkpoint(path: str | Path) -> tuple[ModelConfig, int, Iterator[tuple[str, torch.Tensor]]]:
    """(ModelConfig, vocab_size, (name, tensor) pairs) of a trainer checkpoint file or run dir (its latest)."""
    from kimik3.checkpoint import is_sharded_checkpoint, latest_checkpoint, load_checkpoint

    path = Path(path)
    file = latest_checkpoint(path) if path.is_dir() and not is_sharded_checkpoint(path) else path
    if file is None:
        raise FileNotFoundError(f"{path} holds no checkpoints/step-* (.pt file or DCP dir), kimik3.json or config.json")
    if is_sharded_checkpoint(file):  # a torchrun run's DCP directory, gathered whole into this process
        from kimik3.distributed.dcp import read_model_state

        payload, model_state = read_model_state(file)
    else:
        payload = load_checkpoint(file)
        model_state = payload["model"]
    cfg = ModelConfig(**payload["config"]["model"])
    return cfg, int(payload["recipe"]["vocab_size"]), iter(model_state.items())
