"""kimik3-convert: transformers' Kimi Linear checkpoints <-> kimik3, through one mapping table.

    kimik3-convert import <hf_dir> <out>                    HF dir -> kimik3 weights dir (kimik3.json + shards)
    kimik3-convert export <checkpoint|run dir|weights> <hf_dir> [--dtype bfloat16]
                                                            kimik3 -> dir that AutoModelForCausalLM loads

The table is hf/weight_map.py; configs map in hf/config_map.py. Neither direction needs transformers
installed (only safetensors). Import builds the model on the meta device (no memory) for the
expected names and shapes, streams the HF shards, and writes shards as they fill: peak memory is
about one output shard plus one layer's pending experts. The output dir of a kimik3 weights dir is
what `model.init_from=<out>` takes (an HF dir works there directly too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from kimik3.config.schema import ModelConfig
from kimik3.hf.config_map import config_from_hf_dir, hf_config_from_model_config
from kimik3.hf.init_from import KIMIK3_META, read_kimik3_meta, source_kind, write_kimik3_meta, read_trainer_checkpoint
from kimik3.hf.safetensors_io import DEFAULT_MAX_SHARD_BYTES, ShardedWriter, iter_tensors
from kimik3.hf.transfer import hf_tensors, stream_from_hf
from kimik3.hf.weight_map import check_complete, rules_for
from kimik3.models import build_model
from kimik3.write_errors import WriteError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _meta_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Size]:
    """Names and shapes of KimiK3's state for `cfg`, from a model built on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg, vocab_size)
    return {k: v.shape for k, v in model.state_dict().items()}


def import_hf(hf_dir: str | Path, out: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Convert a transformers Kimi Linear dir into a kimik3 weights dir at `out`; returns `out`."""
    cfg = config_from_hf_dir(hf_dir)
    vocab_size = cfg.vocab_size
    shapes = _meta_shapes(cfg, vocab_size)
    rules = rules_for(cfg)
    check_complete(rules, shapes)
    with ShardedWriter(out, max_shard_bytes=max_shard_bytes, metadata={"kimik3": "weights"}) as writer:
        stream_from_hf(rules, hf_dir, shapes, writer.add)
        writer.extra_files[KIMIK3_META] = write_kimik3_meta(cfg, vocab_size, source=str(hf_dir))
    return Path(out)


def _read_kimik3(src: str | Path) -> tuple[ModelConfig, int, dict[str, torch.Tensor]]:
    kind = source_kind(src, name="src")
    if kind == "kimik3_weights":
        cfg, vocab_size = read_kimik3_meta(src)
        return cfg, vocab_size, dict(iter_tensors(src))
    if kind == "checkpoint":
        cfg, vocab_size, tensors = read_trainer_checkpoint(src)
        return cfg, vocab_size, dict(tensors)
    raise ValueError(f"{src} is already a transformers checkpoint dir (config.json); export takes a kimik3 "
                     f"checkpoint, run dir or weights dir")


def export_hf(src: str | Path, out: str | Path, *, dtype: Optional[str] = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write kimik3 checkpoint/run dir/weights dir `src` as a transformers Kimi Linear dir at `out`.

    dtype: None keeps the stored dtype (fp32 master weights, exact); 'bfloat16' etc. casts.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    cfg, vocab_size, state = _read_kimik3(src)
    hf_config = hf_config_from_model_config(cfg, vocab_size)  # refuses what transformers cannot express
    rules = rules_for(cfg)
    check_complete(rules, state)
    stored = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    hf_config["dtype"] = dtype or (stored.pop() if len(stored) == 1 else "float32")
    with ShardedWriter(out, max_shard_bytes=max_shard_bytes) as writer:
        for name, tensor in hf_tensors(rules, state):
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(_DTYPES[dtype])
            writer.add(name, tensor)
        writer.extra_files["config.json"] = json.dumps(hf_config, indent=2) + "\n"
    return Path(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kimik3-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_imp = sub.add_parser("import", help="transformers Kimi Linear dir -> kimik3 weights dir")
    p_imp.add_argument("hf_dir")
    p_imp.add_argument("out")
    p_exp = sub.add_parser("export", help="kimik3 checkpoint / run dir / weights dir -> transformers dir")
    p_exp.add_argument("src")
    p_exp.add_argument("out")
    p_exp.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                       help="cast floating tensors (default: keep the stored dtype)")
    for p in (p_imp, p_exp):
        p.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3,
                       help="shard size above which an index is written (default 5)")
    args = parser.parse_args(argv)
    shard_bytes = int(args.max_shard_gb * 1024**3)
    if shard_bytes < 1:  # else ShardedWriter's refusal names its own max_shard_bytes, not the option
        parser.error(f"--max-shard-gb {args.max_shard_gb} must be positive")
    try:
        if args.command == "import":
            out = import_hf(args.hf_dir, args.out, max_shard_bytes=shard_bytes)
            print(f"kimik3-convert: imported {args.hf_dir} -> {out} (train with model.init_from={out})")
        else:
            out = export_hf(args.src, args.out, dtype=args.dtype, max_shard_bytes=shard_bytes)
            print(f"kimik3-convert: exported {args.src} -> {out} (AutoModelForCausalLM.from_pretrained('{out}'))")
    except (ValueError, FileNotFoundError, FileExistsError, WriteError) as err:
        print(f"kimik3-convert: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
