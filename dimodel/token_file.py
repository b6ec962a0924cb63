"""Token files: a flat array of token ids on disk, as nanoGPT's and Megatron-style data pipelines
write them (``uint16`` when the vocabulary fits, else ``uint32``; native byte order; no header).
The file is memory-mapped and never read whole: a batch reads its windows.

``prepare`` makes one from text with a ``tokenizers`` tokenizer (``tokenizer.json``); it also
writes ``<file>.json`` beside it ({"dtype", "vocab_size", "tokens"}), which ``TokenFile`` reads
when present, so the dtype need not be restated.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["DTYPES", "TokenFile", "prepare"]

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_CHUNK = 1 << 24  # tokens per chunk of the vocabulary check


def default_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a vocabulary of ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class TokenFile:
    """Tokens ``[start, stop)`` of the token file ``path`` (``dtype``: ``uint16`` or ``uint32``;
    None: the sidecar's, else ``uint16``). Slicing gives int64 tensors."""

    def __init__(self, path: str | Path, dtype: str | None = None, start: int = 0, stop: int | None = None,
                 _array: np.ndarray | None = None):
        self.path = Path(path)
        if _array is None:
            dtype = dtype or self.sidecar().get("dtype", "uint16")
            if dtype not in DTYPES:
                raise ValueError(f"{self.path}: token dtype {dtype!r}; expected one of {sorted(DTYPES)}")
            if not self.path.is_file():
                raise ValueError(f"{self.path}: no such token file")
            size = self.path.stat().st_size
            item = np.dtype(DTYPES[dtype]).itemsize
            if size == 0 or size % item:
                raise ValueError(f"{self.path}: {size} bytes is not a whole, non-empty number of {dtype} tokens")
            _array = np.memmap(self.path, dtype=DTYPES[dtype], mode="r")
        self.dtype = str(_array.dtype)
        self._array = _array
        self.start, self.stop = start, len(_array) if stop is None else stop

    def sidecar(self) -> dict:
        """``<file>.json`` as ``prepare`` writes it ({} when absent)."""
        side = self.path.with_name(self.path.name + ".json")
        if not side.is_file():
            return {}
        values = json.loads(side.read_text())
        if not isinstance(values, dict):
            raise ValueError(f"{side}: expected a JSON object, got {type(values).__name__}")
        return values

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a TokenFile is read in contiguous slices, got {index!r}")
        lo, hi, _ = index.indices(len(self))
        return torch.from_numpy(self._array[self.start + lo: self.start + hi].astype(np.int64))

    def split(self, held_out: float) -> tuple["TokenFile", "TokenFile"]:
        """(train, held-out): the last ``held_out`` fraction is held out."""
        if not 0 <= held_out < 1:
            raise ValueError(f"held_out={held_out!r} must be in [0, 1)")
        cut = self.start + int(len(self) * (1 - held_out))
        return (TokenFile(self.path, start=self.start, stop=cut, _array=self._array),
                TokenFile(self.path, start=cut, stop=self.stop, _array=self._array))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a file holding a token id outside ``[0, vocab_size)`` (reads it in chunks)."""
        for lo in range(self.start, self.stop, _SCAN_CHUNK):
            chunk = self._array[lo: min(lo + _SCAN_CHUNK, self.stop)]
            top = int(chunk.max())
            if top >= vocab_size:
                at = lo + int(np.argmax(chunk >= vocab_size))
                raise ValueError(f"{self.path}: token {at} is id {int(self._array[at])}, beyond the model's "
                                 f"vocabulary of {vocab_size} (ids 0..{vocab_size - 1})")


def prepare(tokenizer_file: str | Path, text_files: list[str | Path], out: str | Path,
            dtype: str | None = None) -> int:
    """Tokenize ``text_files`` with the ``tokenizers`` tokenizer ``tokenizer_file`` into the
    token file ``out`` (and its sidecar); returns the number of tokens written. Files are
    streamed line by line, so none is held whole."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = dtype or default_dtype(vocab)
    if dtype not in DTYPES:
        raise ValueError(f"token dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise ValueError(f"the tokenizer's vocabulary of {vocab} does not fit {dtype}; use uint32")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    count = 0
    with open(tmp, "wb") as f:
        for text_file in text_files:
            with open(text_file, encoding="utf-8") as src:
                lines = []
                for line in src:
                    lines.append(line)
                    if len(lines) == 4096:
                        count += _write(f, tokenizer, lines, dtype)
                        lines = []
                count += _write(f, tokenizer, lines, dtype)
    if count == 0:
        tmp.unlink()
        raise ValueError(f"{[str(t) for t in text_files]}: no tokens (empty text)")
    tmp.replace(out)
    out.with_name(out.name + ".json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab, "tokens": count}))
    return count


def _write(f, tokenizer, lines: list[str], dtype: str) -> int:
    if not lines:
        return 0
    ids = [i for enc in tokenizer.encode_batch(lines, add_special_tokens=False) for i in enc.ids]
    np.asarray(ids, dtype=DTYPES[dtype]).tofile(f)
    return len(ids)
