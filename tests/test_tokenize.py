from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from omniload_dask import TokenizerError
from omniload_dask.plan import TokenizerSpec
from omniload_dask.preprocess.tokenize import add_specials, describe, tokenize


def write_tokenizer(path) -> str:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.write_text(tok.to_str())
    return str(path)


def test_byte_tokenizer_adds_bos_and_eos():
    tokens, offsets = tokenize(TokenizerSpec(), ["hé", "", "ab"])
    assert tokens.tolist() == [256, 104, 195, 169, 257, 256, 257, 256, 97, 98, 257]
    assert offsets.tolist() == [0, 5, 7, 11]
    assert tokens.dtype == np.uint32


def test_add_specials_without_specials_keeps_the_body():
    body = np.array([1, 2, 3], dtype=np.uint32)
    out, offsets = add_specials(body, np.array([2, 1]), None, None)
    assert out.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 3]
    out, offsets = add_specials(body, np.array([2, 1]), None, 9)
    assert out.tolist() == [1, 2, 9, 3, 9] and offsets.tolist() == [0, 3, 5]


@pytest.mark.parametrize("bos, eos", [(7, 9), (7, None), (None, 9)])
def test_add_specials_puts_each_document_between_its_specials(bos, eos):
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 6, 40)
    lengths[:3] = 0  # empty documents first, and some among the rest
    body = rng.integers(10, 1000, int(lengths.sum())).astype(np.uint32)
    out, offsets = add_specials(body, lengths, bos, eos)
    expected: list[int] = []
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(len(lengths)):
        doc = body[starts[i] : starts[i + 1]].tolist()
        expected += ([bos] if bos is not None else []) + doc + ([eos] if eos is not None else [])
    assert out.tolist() == expected and out.dtype == np.uint32
    extra = (bos is not None) + (eos is not None)
    assert offsets.tolist() == np.concatenate([[0], np.cumsum(lengths + extra)]).tolist()
    none, none_offsets = add_specials(body[:0], np.zeros(0, dtype=np.int64), bos, eos)
    assert none.tolist() == [] and none_offsets.tolist() == [0]


def test_huggingface_tokenizer_from_file_and_from_memory_url(tmp_path):
    path = write_tokenizer(tmp_path / "tok.json")
    spec = TokenizerSpec(kind="huggingface", path=path, bos="<s>", eos="</s>")
    tokens, offsets = tokenize(spec, ["hello world", "world"])
    assert tokens.tolist() == [1, 3, 4, 2, 1, 4, 2]
    assert offsets.tolist() == [0, 4, 7]
    import fsspec

    fsspec.filesystem("memory").pipe("/tok/t.json", (tmp_path / "tok.json").read_bytes())
    mem = TokenizerSpec(kind="huggingface", path="memory://tok/t.json", eos="</s>", add_bos=False)
    assert tokenize(mem, ["hello"])[0].tolist() == [3, 2]
    assert describe(spec) == {"vocab_size": 5, "bos_id": 1, "eos_id": 2}


def test_unreadable_tokenizer_files_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer.path: file '.*missing.json' does not"):
        describe(
            TokenizerSpec(
                kind="huggingface",
                path=str(tmp_path / "missing.json"),
                add_bos=False,
                add_eos=False,
            )
        )
    (tmp_path / "junk.json").write_text("{not a tokenizer")
    with pytest.raises(TokenizerError, match="is not a valid tokenizer.json"):
        describe(
            TokenizerSpec(
                kind="huggingface", path=str(tmp_path / "junk.json"), add_bos=False, add_eos=False
            )
        )


def test_declared_special_token_must_exist(tmp_path):
    path = write_tokenizer(tmp_path / "tok.json")
    with pytest.raises(TokenizerError, match=r"tokenizer.bos: token '<bos>' is not in"):
        describe(TokenizerSpec(kind="huggingface", path=path, bos="<bos>", eos="</s>"))


def write_bert_like_tokenizer(path) -> str:
    """A WordPiece tokenizer.json that, like many shipped ones, truncates to 4 and pads to 6."""
    from tokenizers import models

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=6, pad_id=0, pad_token="[PAD]")
    path.write_text(tok.to_str())
    return str(path)


def test_a_tokenizer_files_own_truncation_and_padding_are_turned_off_and_said(tmp_path, capsys):
    path = write_bert_like_tokenizer(tmp_path / "tok.json")
    spec = TokenizerSpec(kind="huggingface", path=path, bos="[CLS]", eos="[SEP]")
    tokens, offsets = tokenize(spec, ["hello world " * 5, "hello"])
    assert offsets.tolist() == [0, 12, 15]  # whole documents: 10 + 2 tokens, and 1 + 2
    assert tokens.tolist() == [2] + [4, 5] * 5 + [3] + [2, 4, 3]  # no [PAD] (0) anywhere
    assert describe(spec)["turned_off"] == [
        "truncation to 4 tokens",
        "padding to 6 tokens with '[PAD]'",
    ]
    from omniload_dask.cli import main

    plan = tmp_path / "plan.yaml"
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    plan.write_text(
        "sources: [{name: a, format: jsonl, path: a.jsonl}]\n"
        "batch: {seq_len: 64}\n"
        f"tokenizer: {{kind: huggingface, path: {path}, bos: '[CLS]', eos: '[SEP]'}}\n"
    )
    assert main(["validate", str(plan)]) == 0
    err = capsys.readouterr().err
    assert "the file's truncation to 4 tokens is turned off" in err
    assert "the file's padding to 6 tokens with '[PAD]' is turned off" in err
