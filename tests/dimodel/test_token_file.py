"""Token files: what ``prepare`` writes is what the tokenizer says, read back memory-mapped;
batches drawn from a file equal those drawn from the same tokens in memory; bad files and ids
beyond the vocabulary are refused naming the value."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dimodel.datasets import step_batch, training_tokens
from dimodel.token_file import TokenFile

TEXT = "The pipeline runs stages of different chips.\nEach stage has its own tensor parallel size.\n" * 40


def _tokenizer(tmp_path, vocab: int = 300):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_prepare_writes_the_tokenizers_ids_and_the_file_reads_them_back(tmp_path):
    tok, path = _tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text("stages\n")
    from dimodel.token_file import prepare

    count = prepare(path, [tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out.bin")
    expect = [i for line in (TEXT + "stages\n").splitlines(keepends=True) for i in tok.encode(line).ids]
    assert count == len(expect)
    assert json.loads((tmp_path / "out.bin.json").read_text()) == {"dtype": "uint16", "vocab_size": tok.get_vocab_size(),
                                                                   "tokens": count}
    tokens = TokenFile(tmp_path / "out.bin")
    assert isinstance(tokens._array, np.memmap)  # mapped, not read whole
    assert tokens[:].tolist() == expect


@settings(max_examples=30, deadline=None)
@given(n=st.integers(40, 400), dtype=st.sampled_from(["uint16", "uint32"]), seq=st.integers(1, 30),
       batch=st.integers(1, 5), seed=st.integers(0, 1000), step=st.integers(0, 1000), held=st.sampled_from([0.0, 0.1, 0.5]))
def test_batches_from_a_file_equal_batches_from_the_same_tokens_in_memory(tmp_path_factory, n, dtype, seq, batch, seed,
                                                                          step, held):
    top = 70000 if dtype == "uint32" else 65535
    ids = np.random.default_rng(seed).integers(0, top, n).astype(dtype)
    path = tmp_path_factory.mktemp("tok") / "t.bin"
    ids.tofile(path)
    train, held_out = TokenFile(path, dtype).split(held)
    cut = int(n * (1 - held))
    memory = torch.from_numpy(ids.astype(np.int64))
    assert len(train) == cut and held_out[:].tolist() == memory[cut:].tolist()
    if seq + 1 >= cut:
        return
    assert torch.equal(step_batch(train, batch, seq, seed, step), step_batch(memory[:cut], batch, seq, seed, step))


def test_a_token_beyond_the_vocabulary_is_refused_naming_it(tmp_path):
    ids = np.array([1, 2, 3, 70, 5], dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match=r"token 3 is id 70, beyond the model's vocabulary of 64 \(ids 0..63\)"):
        training_tokens(str(tmp_path / "t.bin"), vocab_size=64)
    training_tokens(str(tmp_path / "t.bin"), vocab_size=71)


def test_files_that_are_not_token_files_are_refused(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="3 bytes is not a whole, non-empty number of uint16 tokens"):
        TokenFile(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match="no such token file"):
        TokenFile(tmp_path / "absent.bin")
    with pytest.raises(ValueError, match=r"token dtype 'int8'; expected one of \['uint16', 'uint32'\]"):
        TokenFile(tmp_path / "odd.bin", "int8")


def test_the_byte_corpus_is_refused_for_a_vocabulary_smaller_than_a_byte():
    with pytest.raises(ValueError, match="vocabulary has 64 ids; give a token file"):
        training_tokens(None, vocab_size=64)
