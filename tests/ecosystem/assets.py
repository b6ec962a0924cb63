"""The test assets torchtitan's ``llama3`` debug model reads, made at test time (CI reaches only
the package index): a byte-level BPE ``tokenizer.json`` with its ``tokenizer_config.json``, and a
C4-format text set (JSON lines with ``text``, ``timestamp`` and ``url``, what ``allenai/c4`` rows
hold). The text is the English of Python's documentation topics (``pydoc_data``, shipped with the
standard library), so the assets are the same on every machine.
"""
from __future__ import annotations

import json
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def _paragraphs() -> list[str]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n") if len(p.strip()) > 40]


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE of ``vocab_size`` ids (special tokens included), as torchtitan's
    ``HuggingFaceTokenizer`` loads one: ``tokenizer.json`` and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_paragraphs(), trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} ids, more than the model's {vocab_size}")
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_c4(folder: Path) -> None:
    """``data.json``: one C4-format row per documentation paragraph."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data.json", "w") as out:
        for i, text in enumerate(_paragraphs()):
            row = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://docs.python.org/topic/{i}"}
            out.write(json.dumps(row) + "\n")


def make_assets(root: Path, vocab_size: int = 2048) -> tuple[Path, Path]:
    """(tokenizer folder, dataset folder) under ``root``; made once, reused when present."""
    tokenizer, c4 = root / "tokenizer", root / "c4_test"
    if not (tokenizer / "tokenizer_config.json").exists():
        make_tokenizer(tokenizer, vocab_size)
    if not (c4 / "data.json").exists():
        make_c4(c4)
    return tokenizer, c4
