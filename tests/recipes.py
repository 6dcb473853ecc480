"""Tiny recipes shared by test modules (a plain module: `from conftest import ...` is ambiguous when
several conftest.py files are loaded, since each is imported under the name `conftest`)."""

TINY_TRAIN = [
    "train.batch_size=2", "train.seq_len=32", "train.max_steps=8", "train.warmup_steps=2",
    "train.log_interval=2", "train.eval_interval=4", "train.eval_steps=2", "train.logger=none",
]
"""A recipe that runs in about a second on one CPU core."""
SMOKE = ["model=smoke", *TINY_TRAIN]
