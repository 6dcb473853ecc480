"""kimik3-prepare: turn text into a prepared dir of token shards (Hydra app over DataConfig).

    kimik3-prepare                                   # embedded corpus into the cache dir
    kimik3-prepare data.source=corpus.txt data.prepared_dir=data/mine data.tokenizer=bpe

An existing prepared dir is not rebuilt: it is checked against the request and its shards are
re-hashed against meta.json. Errors exit 1 with one line. Writes nothing but the prepared dir.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from kimik3.config.paths import CONF_DIR
from kimik3.config.schema import PrepareConfig
from kimik3.config.store import register_configs
from kimik3.data import DataError, ShardedTokenDataset
from kimik3.data.prepare import prepare_or_reuse
from kimik3.data.shards import SPLITS
from kimik3.write_errors import WriteError

def run(cfg: PrepareConfig, *, progress: bool = True) -> Path:
    """Prepare (or check) the dir `cfg.data` names and print a summary; returns the dir."""
    started = time.perf_counter()
    path, created = prepare_or_reuse(cfg.data, progress=progress)
    datasets = {split: ShardedTokenDataset(path, split) for split in SPLITS}
    if not created:
        for ds in datasets.values():
            ds.verify()
    status = "created" if created else "already prepared, checksums verified"
    print(summary(path, datasets, status, time.perf_counter() - started))
    return path


def summary(path: Path, datasets: dict[str, ShardedTokenDataset], status: str, seconds: float) -> str:
    meta = datasets["train"].meta
    src, tok = meta["source"], meta["tokenizer"]
    lines = [
        f"prepared dir  {path}  ({status}, {seconds:.1f} s)",
        f"dataset       {meta['name']}",
        f"source        {src['kind']} {src['path']}: {src['documents']:,} documents, {src['bytes']:,} bytes"
        + (f" (capped at {src['max_bytes']:,})" if src["max_bytes"] is not None else ""),
        f"tokenizer     {tok['name']}, vocab {meta['vocab_size']:,}, end-of-text id {meta['eot_id']}, {meta['dtype']}",
    ]
    for split, ds in datasets.items():
        lines.append(f"{split:<13} {ds.num_tokens:,} tokens in {len(ds.shards)} shard(s)")
    lines.append(f"train with    kimik3-train data.prepared_dir={path}")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="prepare")
def _hydra_main(dcfg: DictConfig) -> None:
    cfg: PrepareConfig = OmegaConf.to_object(dcfg)
    try:
        run(cfg)
    except (DataError, WriteError) as e:
        print(f"kimik3-prepare: error: {e}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
