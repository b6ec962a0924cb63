"""Training tokens and the batches drawn from them: a user's token file (``token_file``), or a
small real text corpus that needs no download, the English text of Python's documentation
topics shipped with the standard library as ``pydoc_data``, whose bytes are tokens (vocabulary 256).
"""
from __future__ import annotations

import torch


__all__ = ["sample_batch", "step_batch", "text_corpus", "training_tokens"]

def text_corpus(held_out: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tokens; the last ``held_out`` fraction is held out."""
    if not 0 <= held_out < 1:
        raise ValueError(f"held_out={held_out!r} must be in [0, 1)")
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


def sample_batch(data, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq + 1`` tokens (inputs and next-token targets) of ``data``
    (a tensor or a ``TokenFile``)."""
    if seq + 1 > len(data):
        raise ValueError(f"seq={seq} does not fit a corpus of {len(data)} tokens")
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    return torch.stack([data[i: i + seq + 1] for i in starts.tolist()])


def step_batch(data, batch: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """The batch of training step ``step``: a function of (seed, step) alone, so a run resumed
    from a checkpoint, a pipeline run and a single-process reference all see the same tokens."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return sample_batch(data, batch, seq, generator)


def training_tokens(path: str | None = None, dtype: str | None = None, vocab_size: int | None = None,
                    held_out: float = 0.1):
    """(train, held-out) tokens: the token file ``path`` (``token_file.TokenFile``, checked
    against ``vocab_size``), or without one the byte corpus of ``text_corpus``."""
    if path is None:
        if vocab_size is not None and vocab_size < 256:
            raise ValueError(f"the built-in corpus is bytes (ids 0..255) but the model's vocabulary has {vocab_size} "
                             f"ids; give a token file (--data)")
        return text_corpus(held_out)
    from dimodel.token_file import TokenFile

    tokens = TokenFile(path, dtype)
    if vocab_size is not None:
        tokens.check_vocab(vocab_size)
    return tokens.split(held_out)
