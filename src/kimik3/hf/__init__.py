"""Interop with transformers' Kimi Linear (`model_type: kimi_linear`): configs, the weight table, shards.

    config_map.py      config.json <-> ModelConfig, field by field; refusals; architecture comparison
    weight_map.py      the one table: every KimiK3 tensor <-> its HF checkpoint tensors
    safetensors_io.py  streamed shard-by-shard reading, sharded writing with an index
    transfer.py        moving tensors through the table (streamed import, export)
    init_from.py       model.init_from: load_initial_weights(model, cfg.model, path)

The CLI is `kimik3-convert` (kimik3/convert.py). Nothing here imports transformers.
"""

from kimik3.hf.config_map import HFConfigError, check_same_architecture, config_from_hf_dir
from kimik3.hf.init_from import load_initial_weights

__all__ = ["HFConfigError", "check_same_architecture", "config_from_hf_dir", "load_initial_weights"]
