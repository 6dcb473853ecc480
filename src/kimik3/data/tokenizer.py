"""Tokenizers: byte-level (the default, nothing to download) and Hugging Face `tokenizers` BPE.

Both expose the same small surface (`encode`, `decode`, `vocab_size`, `eot_id`, `identity`) so the
shard writer never asks which one it has. Every document ends with the end-of-text token `eot_id`,
and that separator is its only source: `encode` reads special-token strings in a text as text.
A BPE tokenizer is either trained here on the corpus (byte-level BPE, deterministic for a given
corpus and vocab size) or loaded from a `tokenizer.json`; either way its JSON is saved into the
prepared dir, so `load_tokenizer(prepared_dir)` can decode the model's tokens later.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator, Optional, Protocol

import numpy as np

from kimik3.config.schema import TOKENIZERS
from kimik3.data.errors import DataError

EOT_TEXT = "<|endoftext|>"
"""End-of-text marker: the special token of trained BPE, and what ByteTokenizer.decode prints."""

# Special tokens accepted as end-of-text in a loaded tokenizer.json, first match wins.
EOT_CANDIDATES = (EOT_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")

TOKENIZER_FILE = "tokenizer.json"
"""Where a BPE tokenizer is saved inside a prepared dir."""


class Tokenizer(Protocol):
    """What the shard writer and the samplers need from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no end-of-text appended), as a 1-D integer array."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ...

    def decode(self, ids: Iterable[int]) -> str:
        ...

    @property
    def identity(self) -> dict:
        """Small JSON-able dict naming the tokenizer exactly (goes into meta.json and checkpoints)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus end-of-text = 256 (vocab 257, stored as uint16)."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out, chunk = [], bytearray()
        for i in ids:
            if i == self.eot_id:
                out.append(chunk.decode("utf-8", errors="replace") + EOT_TEXT)
                chunk = bytearray()
            else:
                chunk.append(int(i))
        out.append(chunk.decode("utf-8", errors="replace"))
        return "".join(out)

    @property
    def identity(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}


class BpeTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`; its identity is the sha256 of its canonical JSON."""

    name = "bpe"

    def __init__(self, tok) -> None:
        self._tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        # Ids may be sparse in hand-made files; the embedding must cover the largest one.
        self.vocab_size = max(vocab.values()) + 1
        eot = next((t for t in EOT_CANDIDATES if t in vocab), None)
        if eot is None:
            raise DataError(
                f"the BPE tokenizer has no end-of-text token; expected one of {', '.join(EOT_CANDIDATES)}"
            )
        self.eot_text = eot
        self.eot_id = vocab[eot]
        self._json = tok.to_str()
        # Documents are text: a special token's string inside one (a file that quotes "<|endoftext|>")
        # is encoded as ordinary text, so the only end-of-text ids are the separators the pipeline
        # appends. (The switch is a runtime setting, not part of the JSON or the identity.)
        tok.encode_special_tokens = True

    @classmethod
    def from_file(cls, path: str | Path) -> "BpeTokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise DataError(f"data.tokenizer_path={path} does not exist (expected a Hugging Face tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"data.tokenizer_path={path} is not a readable tokenizer.json: {e}") from e
        return cls(tok)

    @classmethod
    def train(cls, texts: Iterator[str], vocab_size: int, *, progress: bool) -> "BpeTokenizer":
        """Byte-level BPE trained on `texts` (GPT-2 style pre-tokenization, no unknown tokens)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise DataError(f"data.bpe_vocab_size={vocab_size} must be at least 257 (256 bytes + end-of-text)")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=progress,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch runs in parallel inside the Rust library.
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: Path) -> None:
        path.write_text(self._json, encoding="utf-8")

    @property
    def identity(self) -> dict:
        sha = hashlib.sha256(self._json.encode("utf-8")).hexdigest()
        return {"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id, "sha256": sha}


def check_tokenizer_choice(name: str, tokenizer_path: Optional[str]) -> None:
    """One-line errors for data.tokenizer / data.tokenizer_path before any work starts."""
    if name not in TOKENIZERS:
        raise DataError(f"data.tokenizer={name!r} is not one of {', '.join(TOKENIZERS)}")
    if tokenizer_path is not None and name != "bpe":
        raise DataError(f"data.tokenizer_path={tokenizer_path} needs data.tokenizer=bpe (got {name!r})")


def load_tokenizer(prepared_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared dir was made with (to decode samples or encode prompts)."""
    prepared_dir = Path(prepared_dir)
    meta = json.loads((prepared_dir / "meta.json").read_text(encoding="utf-8"))
    name = meta["tokenizer"]["name"]
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return BpeTokenizer.from_file(prepared_dir / TOKENIZER_FILE)
    raise DataError(f"{prepared_dir}/meta.json names tokenizer {name!r}, not one of {', '.join(TOKENIZERS)}")
