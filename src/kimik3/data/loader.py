"""TokenDataLoader: contiguous next-token batches from one split, with a resumable cursor.

Semantics (the contract the trainer and checkpoints rely on):
- One global batch reads N = world_size*B*T + 1 contiguous tokens starting at the cursor `position`.
- Rank r takes tokens [r*B*T, (r+1)*B*T + 1) of them: inputs are the first B*T, targets the same
  window shifted by one, both reshaped to [B, T] int64. So the ranks' inputs, concatenated in rank
  order, equal the inputs a world_size=1 loader with batch size world_size*B would return.
- The cursor then advances by world_size*B*T: the lookahead token (the last target) becomes the next
  batch's first input, and no token is skipped or seen twice within an epoch.
- When fewer than N tokens remain, `next_batch` raises EndOfData and leaves the cursor unchanged
  (no silent wrap, the tail of the split is not used); `rewind()` starts the next epoch at 0.
- `state_dict()` holds position, epoch, B, T, world_size, split and the dataset identity;
  `load_state_dict` refuses a state from another dataset, split or batch geometry.
"""

from __future__ import annotations

import torch

from kimik3.data.errors import DataError
from kimik3.data.shards import ShardedTokenDataset


class EndOfData(Exception):
    """The split has fewer tokens left than one batch needs; call `rewind()` to start another epoch."""


class TokenDataLoader:
    """Batches of shape [B, T] from a ShardedTokenDataset, read in order from a cursor."""

    def __init__(
        self, dataset: ShardedTokenDataset, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size={batch_size} and seq_len={seq_len} must both be >= 1")
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        self.dataset = dataset
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.tokens_per_step = world_size * batch_size * seq_len
        """Tokens the cursor advances per global batch (all ranks together)."""
        if dataset.num_tokens < self.tokens_per_step + 1:
            raise DataError(
                f"the {dataset.split} split of {dataset.path} has {dataset.num_tokens} tokens, fewer than one batch "
                f"needs (world_size*batch_size*seq_len+1 = {world_size}*{batch_size}*{seq_len}+1 = "
                f"{self.tokens_per_step + 1}); use a larger source or lower train.batch_size/train.seq_len"
            )
        self.position = 0
        """Start of the next global batch in the split, in tokens."""
        self.epoch = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 [B, T] on CPU; raises EndOfData at the end of the split."""
        left = self.dataset.num_tokens - self.position
        if left < self.tokens_per_step + 1:
            raise EndOfData(
                f"{self.dataset.split} split ends: {left} tokens left at position {self.position}, "
                f"a batch needs {self.tokens_per_step + 1} (epoch {self.epoch})"
            )
        local = self.batch_size * self.seq_len
        window = self.dataset.read(self.position + self.rank * local, local + 1)
        buf = torch.from_numpy(window)
        inputs = buf[:-1].view(self.batch_size, self.seq_len)
        targets = buf[1:].view(self.batch_size, self.seq_len)
        self.position += self.tokens_per_step
        return inputs, targets

    def rewind(self) -> None:
        """Start the next epoch from the beginning of the split."""
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "epoch": self.epoch,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "split": self.dataset.split,
            "dataset": self.dataset.identity,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor; refuses a state saved for another dataset, split or batch geometry."""
        mine = self.state_dict()
        for key in ("dataset", "split", "batch_size", "seq_len", "world_size"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"data loader state does not match: {key} is {_short(state.get(key))} in the state "
                    f"but {_short(mine[key])} here"
                )
        position, epoch = state["position"], state["epoch"]
        if not (0 <= position <= self.dataset.num_tokens and position % self.tokens_per_step == 0 and epoch >= 0):
            raise DataError(f"data loader state has position={position}, epoch={epoch}: not a cursor of this loader")
        self.position, self.epoch = position, epoch

    def __repr__(self) -> str:
        return (
            f"TokenDataLoader({self.dataset.split}: B={self.batch_size}, T={self.seq_len}, rank {self.rank}/"
            f"{self.world_size}, position {self.position}/{self.dataset.num_tokens}, epoch {self.epoch})"
        )


def _short(value) -> str:
    """A dataset identity by name (the full dict is long); other values as repr."""
    if isinstance(value, dict) and "name" in value:
        return f"{value['name']!r} (tokens {value.get('tokens')}, source sha256 {str(value.get('source_sha256'))[:12]})"
    return repr(value)
