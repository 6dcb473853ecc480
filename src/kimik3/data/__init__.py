"""Data pipeline: text -> prepared dir of token shards (prepare_data) -> [B, T] batches (TokenDataLoader).

Read in this order: corpus.py (sources), tokenizer.py, shards.py (on-disk format + dataset),
prepare.py (caching, atomic publish, train/val split), loader.py (cursor semantics).
"""

from kimik3.data.errors import DataError
from kimik3.data.loader import EndOfData, TokenDataLoader
from kimik3.data.prepare import prepare_data
from kimik3.data.shards import ShardedTokenDataset
from kimik3.data.tokenizer import load_tokenizer

__all__ = ["DataError", "EndOfData", "ShardedTokenDataset", "TokenDataLoader", "load_tokenizer", "prepare_data"]
