"""Tokenizers: the built-in byte tokenizer, Hugging Face ``tokenizers`` from a tokenizer.json,
and ``tiktoken`` byte-level BPE files (base64 token / rank lines, the form Llama 3 ships).

Each turns a list of texts into one flat ``uint32`` token array plus per-document lengths, with
BOS/EOS added as the plan declares. The byte tokenizer needs no file: token = UTF-8 byte value,
BOS = 256, EOS = 257, vocabulary 258. ``"hé"`` becomes ``[256, 104, 195, 169, 257]``.

A file-backed tokenizer is loaded once per worker process (cached by its spec) from any fsspec
URL. A Hugging Face tokenizer.json's own ``truncation`` and ``padding`` are turned off: documents are tokenized whole and
packed by the loader (a file's ``truncation: {max_length: 128}`` would cut every document to
128 tokens uncounted, its padding would put pad tokens inside packed sequences);
:func:`describe` says what was turned off, and ``omniload validate`` prints it.

A tiktoken file holds one ``<base64 token bytes> <rank>`` pair per line; the plan adds the
pre-tokenizer regex and the special tokens, which the file does not carry::

    SGVsbG8= 0          b"Hello" -> id 0
    IHdvcmxk 1          b" world" -> id 1

In a Dask worker, tokenizers are loaded and run on threads of their own
(:func:`own_threads`), not on whichever of Dask's task threads runs a read. The regex engine
inside ``tiktoken`` (Rust's ``regex-automata``) keeps a fast path for the first thread that
searches with it and sends every other thread through a locked pool of scratch space, search
by search: tokenizing on any thread but the first costs more instructions and more CPU time,
so each tokenizer stays on the one thread that first ran it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import numpy as np

from omniload_dask.errors import TokenizerError
from omniload_dask.plan import BYTE_IMAGE_TOKEN as BYTE_IMAGE
from omniload_dask.plan import TokenizerSpec
from omniload_dask.plan.credentials import resolve

__all__ = [
    "BYTE_BOS",
    "BYTE_EOS",
    "BYTE_VOCAB",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "TiktokenTokenizer",
    "TokenizerInfo",
    "add_specials",
    "describe",
    "image_token_id",
    "load_tokenizer",
    "own_threads",
    "read_ranks",
    "read_tokenizer_file",
    "tokenize",
]

BYTE_BOS, BYTE_EOS, BYTE_VOCAB = 256, 257, 258


@dataclass(frozen=True)
class TokenizerInfo:
    """What the data plane needs to know of a tokenizer: its vocabulary size and special ids."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    turned_off: tuple[str, ...] = ()  # settings of the tokenizer file that do not apply here


class _Encoder(Protocol):
    """What every tokenizer offers (what :func:`load_tokenizer` returns)."""

    info: TokenizerInfo

    def token_id(self, token: str | int) -> int | None: ...

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]: ...

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def _char_of_bytes(text: str) -> np.ndarray:
    """For each UTF-8 byte of ``text`` and one past its end, the character it belongs to."""
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    sizes = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.append(np.repeat(np.arange(len(points), dtype=np.int64), sizes), len(points))


class ByteTokenizer:
    """The built-in tokenizer: a token per UTF-8 byte; BOS 256, EOS 257, the image token 258."""

    info = TokenizerInfo(vocab_size=BYTE_VOCAB, bos_id=BYTE_BOS, eos_id=BYTE_EOS)

    def token_id(self, token: str | int) -> int | None:
        """The id of ``token``; only the image token (258) is known by id here."""
        return BYTE_IMAGE if token == BYTE_IMAGE else None

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ``texts``' bytes as one flat uint32 array, and each text's length (no BOS/EOS)."""
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        body = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint32)
        return body, lengths

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``text``'s tokens and each token's first and past-last character (chat masks)."""
        body, _ = self.encode([text])
        chars = _char_of_bytes(text)
        return body, chars[:-1], chars[:-1] + 1


class HuggingFaceTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from the plan's tokenizer.json (any fsspec URL).

    The plan's ``bos`` and ``eos`` tokens must be in its vocabulary; a :class:`TokenizerError`
    naming the field says which is not.
    """

    def __init__(self, spec: TokenizerSpec) -> None:
        from tokenizers import Tokenizer

        blob = read_tokenizer_file(spec)
        try:
            self._tok = Tokenizer.from_str(blob.decode("utf-8"))
        except Exception as exc:
            raise TokenizerError(
                f"tokenizer.path: {spec.path!r} is not a valid tokenizer.json ({exc})"
            ) from None
        self.info = TokenizerInfo(
            vocab_size=self._tok.get_vocab_size(with_added_tokens=True),
            bos_id=self._special(spec, "bos", spec.bos),
            eos_id=self._special(spec, "eos", spec.eos),
            turned_off=_turn_off_truncation_and_padding(self._tok),
        )

    def _special(self, spec: TokenizerSpec, field: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"tokenizer.{field}: token {token!r} is not in the vocabulary of {spec.path!r}"
            )
        return int(token_id)

    def token_id(self, token: str | int) -> int | None:
        """The id of ``token`` (a token string, or an id checked against the vocabulary size)."""
        if isinstance(token, int):
            return token if 0 <= token < self.info.vocab_size else None
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ``texts``' tokens as one flat uint32 array, and each text's length (no specials:
        BOS/EOS are added by :func:`add_specials` as the plan says)."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(texts))
        body = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings),
            dtype=np.uint32,
            count=int(lengths.sum()),
        )
        return body, lengths

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``text``'s tokens (no specials added) and each token's first and past-last
        character, as the tokenizer's offsets give them (chat masks)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        offsets = encoding.offsets  # (a list of pairs: flattened, it converts ~2x faster)
        flat = itertools.chain.from_iterable(offsets)
        spans = np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.uint32), spans[:, 0], spans[:, 1]

    def encode_offsets_batch(
        self, texts: list[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`encode_offsets` of each text, flat: tokens, first and past-last characters
        (each within its own text), and each text's token count. One ``encode_batch`` call
        and one conversion of many texts' ids and offsets cost less a token than a call and
        a conversion per text (the worker's ``TOKENIZERS_PARALLELISM=false`` keeps it on the
        calling thread)."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        ids = [e.ids for e in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        body = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32, count=total)
        pairs = itertools.chain.from_iterable(e.offsets for e in encodings)
        flat = itertools.chain.from_iterable(pairs)
        spans = np.fromiter(flat, dtype=np.int64, count=2 * total).reshape(-1, 2)
        return body, spans[:, 0], spans[:, 1], lengths


def _turn_off_truncation_and_padding(tok: Any) -> tuple[str, ...]:
    """Turn off a tokenizer.json's own truncation and padding; what each one was."""
    off = []
    cut = tok.truncation
    if cut is not None:
        off.append(f"truncation to {cut['max_length']} tokens")
        tok.no_truncation()
    pad = tok.padding
    if pad is not None:
        size = f"to {pad['length']} tokens" if pad.get("length") else "to the longest in a batch"
        off.append(f"padding {size} with {pad.get('pad_token')!r}")
        tok.no_padding()
    return tuple(off)


class TiktokenTokenizer:
    """A byte-level BPE from a tiktoken file (any fsspec URL), run by the ``tiktoken`` library.

    Texts are encoded as plain text: special-token strings inside a document stay text (no
    document can inject an EOS). ``bos``/``eos`` name entries of the plan's ``special_tokens``.
    """

    def __init__(self, spec: TokenizerSpec) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(
                "tokenizer.kind: 'tiktoken' needs the tiktoken package (pip install tiktoken)"
            ) from None
        assert spec.path is not None and spec.pattern is not None
        ranks = read_ranks(spec)
        specials = dict(spec.special_tokens)
        used = set(ranks.values())
        for token, token_id in specials.items():
            if token_id in used:
                raise TokenizerError(
                    f"tokenizer.special_tokens[{token!r}]: id {token_id} is also the rank of a "
                    f"token in {spec.path!r} (special tokens take ids the file does not use)"
                )
        try:
            self._enc = tiktoken.Encoding(
                name=f"omniload:{spec.path}",
                pat_str=spec.pattern,
                mergeable_ranks=ranks,
                special_tokens=specials,
            )
            self._enc.encode_ordinary("check the pattern")
        except Exception as exc:
            raise TokenizerError(
                f"tokenizer.pattern: tiktoken cannot use it with {spec.path!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self._ranks = ranks
        self._specials = specials
        self._to_numpy = getattr(self._enc, "encode_to_numpy", None)  # tiktoken >= 0.8
        self.info = TokenizerInfo(
            vocab_size=int(self._enc.n_vocab),
            bos_id=specials[spec.bos] if spec.bos is not None else None,
            eos_id=specials[spec.eos] if spec.eos is not None else None,
        )

    def token_id(self, token: str | int) -> int | None:
        """The id of ``token``: a special token, a token whose UTF-8 bytes are in the file, or an
        id checked against the vocabulary size."""
        if isinstance(token, int):
            return token if 0 <= token < self.info.vocab_size else None
        if token in self._specials:
            return self._specials[token]
        return self._ranks.get(token.encode("utf-8"))

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ``texts``' tokens as one flat uint32 array, and each text's length (no specials)."""
        encoded = [self._encode_one(text) for text in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        if not encoded:
            return np.zeros(0, dtype=np.uint32), lengths
        return np.concatenate(encoded).astype(np.uint32, copy=False), lengths

    def _encode_one(self, text: str) -> np.ndarray:
        """One text's tokens as ``encode_ordinary`` gives them (special tokens' text is plain
        text), straight into a numpy array: no Python int per token (about 15 % of the
        tokenizing CPU with Tekken)."""
        if self._to_numpy is not None:
            try:
                return self._to_numpy(text, disallowed_special=())
            except UnicodeEncodeError:  # lone surrogates: encode_ordinary has the fix-up
                pass
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``text``'s tokens and each token's first and past-last character (chat masks)."""
        ids = self._encode_one(text)
        sizes = [len(self._enc.decode_single_token_bytes(int(t))) for t in ids]
        ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
        chars = _char_of_bytes(text)
        starts = ends - np.asarray(sizes, dtype=np.int64)
        # (a token's last character is the one holding its last byte)
        return ids, chars[starts], chars[np.maximum(ends - 1, 0)] + 1


def read_ranks(spec: TokenizerSpec, *, decode: bool = True) -> dict[bytes, int]:
    """The token bytes -> rank table of a tiktoken file; errors name the field, file and line.
    ``decode=False`` leaves the tokens in base64 (all a vocabulary check needs; a token on two
    lines keeps its last rank either way, as in the tokenizer's own table)."""
    blob = read_tokenizer_file(spec)
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(blob.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True) if decode else token] = int(rank)
        except (ValueError, binascii.Error):
            shown = line[:60].decode("utf-8", "replace")
            raise TokenizerError(
                f"tokenizer.path: {spec.path!r} line {number} is not '<base64 token> <rank>' "
                f"(a tiktoken BPE file), got {shown!r}"
            ) from None
    if not ranks:
        raise TokenizerError(f"tokenizer.path: {spec.path!r} holds no tokens")
    return ranks


@functools.lru_cache(maxsize=8)
def _cached(spec_json: str) -> _Encoder:
    data = json.loads(spec_json)
    spec = TokenizerSpec(**data)
    if spec.kind == "byte":
        return ByteTokenizer()
    if spec.kind == "tiktoken":
        return TiktokenTokenizer(spec)
    return HuggingFaceTokenizer(spec)


def read_tokenizer_file(spec: TokenizerSpec) -> bytes:
    """The bytes of the tokenizer file ``tokenizer.path``; errors name the field and the file."""
    assert spec.path is not None
    try:
        with fsspec.open(spec.path, "rb", **_options(spec)) as f:
            return bytes(f.read())
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer.path: file {spec.path!r} does not exist") from None
    except Exception as exc:
        raise TokenizerError(
            f"tokenizer.path: cannot read {spec.path!r}: {type(exc).__name__}: {exc}"
        ) from None


def _options(spec: TokenizerSpec) -> dict[str, Any]:
    """The tokenizer file's fsspec options, ``${env:...}`` resolved here."""
    return resolve(spec.storage_options, "tokenizer.storage_options")


_OWN = threading.local()  # .here: this thread is one of the tokenizers' own
# (the process it serves, how many threads, the threads)
_own_pool: tuple[int, int, ThreadPoolExecutor] | None = None
_own_lock = threading.Lock()


def own_threads(threads: int) -> None:
    """From now on, load and run this process's tokenizers on up to ``threads`` threads of
    their own (see the module doc); callers wait for them. Calling it again changes nothing
    unless it asks for more threads; a forked child runs them in its calling threads again
    until it calls this itself."""
    global _own_pool
    threads = max(1, int(threads))
    with _own_lock:
        pid = os.getpid()
        if _own_pool is not None and _own_pool[0] == pid and _own_pool[1] >= threads:
            return
        if _own_pool is not None and _own_pool[0] == pid:
            _own_pool[2].shutdown(wait=False)  # (its threads end once their calls are done)
        pool = ThreadPoolExecutor(
            threads,
            thread_name_prefix="omniload-tokenize",
            initializer=setattr,
            initargs=(_OWN, "here", True),
        )
        _own_pool = (pid, threads, pool)


def _on_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the tokenizers' own threads when the process has them."""
    pool = _own_pool
    if pool is None or pool[0] != os.getpid() or getattr(_OWN, "here", False):
        return fn(*args)
    return pool[2].submit(fn, *args).result()


def load_tokenizer(spec: TokenizerSpec) -> _Encoder:
    """The tokenizer of ``spec``, loaded once per process."""
    blob = json.dumps(
        {
            "kind": spec.kind,
            "path": spec.path,
            "bos": spec.bos,
            "eos": spec.eos,
            "add_bos": spec.add_bos,
            "add_eos": spec.add_eos,
            "storage_options": dict(spec.storage_options),
            "pattern": spec.pattern,
            "special_tokens": dict(spec.special_tokens),
        },
        sort_keys=True,
    )
    encoder: _Encoder = _on_own_thread(_cached, blob)
    return encoder


def tokenize(spec: TokenizerSpec, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of all ``texts`` (flat uint32) and their offsets (int64, len(texts) + 1)."""
    result: tuple[np.ndarray, np.ndarray] = _on_own_thread(_tokenize, spec, texts)
    return result


def _tokenize(spec: TokenizerSpec, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoder = load_tokenizer(spec)
    body, lengths = encoder.encode(texts)
    bos = encoder.info.bos_id if spec.add_bos else None
    eos = encoder.info.eos_id if spec.add_eos else None
    return add_specials(body, lengths, bos, eos)


def add_specials(
    body: np.ndarray,
    lengths: np.ndarray,
    bos: int | None,
    eos: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Insert BOS/EOS around each document of ``body`` (vectorised).

    The body fills every place that is not a special one, in order: one boolean mask, 15-19
    times faster than scattering each token to its shifted place (which cost 3-4 % of a
    worker's CPU with Tekken).
    """
    n = len(lengths)
    extra = int(bos is not None) + int(eos is not None)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths + extra, out=offsets[1:])
    if extra == 0:
        return body.astype(np.uint32, copy=False), offsets
    out = np.empty(int(offsets[-1]), dtype=np.uint32)
    body_places = np.ones(len(out), dtype=bool)
    if bos is not None:
        body_places[offsets[:-1]] = False
    if eos is not None:
        body_places[offsets[1:] - 1] = False
    out[body_places] = body
    if bos is not None:
        out[offsets[:-1]] = bos
    if eos is not None:
        out[offsets[1:] - 1] = eos
    return out, offsets


def image_token_id(spec: TokenizerSpec, token: str | int) -> int:
    """The id of the image placeholder ``token`` (``images.placeholder``)."""
    encoder = load_tokenizer(spec)
    # (the byte tokenizer's image token has no text; a string names the text a template writes)
    found = BYTE_IMAGE if spec.kind == "byte" else encoder.token_id(token)
    if found is None:
        where = f"of {spec.path!r}" if spec.path else "of the byte tokenizer"
        raise TokenizerError(
            f"images.placeholder: token {token!r} is not in the vocabulary {where}"
        )
    return found


def describe(spec: TokenizerSpec, placeholder: str | int | None = None) -> dict[str, Any]:
    """Load the tokenizer and report its vocabulary and special ids (start-up check).

    With ``placeholder`` (plans with images) also the image token's id; ``turned_off`` lists
    the tokenizer file's own settings that were turned off (truncation, padding).
    """
    info = load_tokenizer(spec).info
    out: dict[str, Any] = {
        "vocab_size": info.vocab_size,
        "bos_id": info.bos_id,
        "eos_id": info.eos_id,
    }
    if info.turned_off:
        out["turned_off"] = list(info.turned_off)
    if placeholder is not None:
        out["image_token_id"] = image_token_id(spec, placeholder)
        if spec.kind == "byte":
            out["vocab_size"] = BYTE_VOCAB + 1
    return out
