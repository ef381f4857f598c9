"""The plan's choice fields: each one's values as a ``Literal`` type and as a tuple.

A field that takes one of a few words (``long_documents: split``) is parsed by
:meth:`~omniload_dask.plan.fields.Fields.choice`, which checks the value against the tuple and
hands it back typed as the ``Literal``; the spec field has that type too. A comparison
elsewhere (``batch.long_documents == "truncate"``) is then checked by mypy (``strict_equality``):
a word that is not one of the field's values fails the type check instead of never matching::

    LongDocuments = Literal["split", "truncate"]       the type of BatchSpec.long_documents
    LONG_DOCUMENTS = ("split", "truncate")              what the parser accepts, in that order

The YAML values are these words, unchanged. Each tuple is read off its ``Literal`` with
``typing.get_args``, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "BALANCE_EFFORTS",
    "CHAT_LAYOUTS",
    "FANOUTS",
    "FLAT_DTYPES",
    "INTERPOLATIONS",
    "LONG_DOCUMENTS",
    "MIXING_BY",
    "MIXING_OVER",
    "ON_ERROR",
    "SOURCE_FORMATS",
    "TOKENIZER_KINDS",
    "TOKEN_DTYPES",
    "TRAIN_ON",
    "BalanceEffort",
    "ChatLayout",
    "Fanout",
    "FlatDtype",
    "Interpolation",
    "LongDocuments",
    "MixingBy",
    "MixingOver",
    "OnError",
    "SourceFormat",
    "TokenDtype",
    "TokenizerKind",
    "TrainOn",
]

# ``on_error``: a bad record fails the job, or is skipped and counted.
OnError = Literal["raise", "skip"]
# ``batch.long_documents``: a document longer than a micro-batch is split, or cut at seq_len.
LongDocuments = Literal["split", "truncate"]
# ``layout.balance``: every pass of the balancer, or the cheap ones only (batching.balance).
BalanceEffort = Literal["full", "fast"]
# ``mixing.by`` / ``mixing.over`` / ``mixing.interpolate``: what the weights share out, what a
# schedule's ``at`` counts, and how weights move between its points.
MixingBy = Literal["tokens", "documents"]
MixingOver = Literal["steps", "tokens"]
Interpolation = Literal["constant", "linear"]
# ``loader.fanout``: how the ranks of a DP group or a node share a fetch (trainer.fanout).
Fanout = Literal["none", "broadcast", "node"]
# ``sources[].format``: the reader (sources.registry).
SourceFormat = Literal["jsonl", "parquet", "webdataset", "megatron", "arrow", "mds", "flat"]
# ``tokenizer.kind``.
TokenizerKind = Literal["byte", "huggingface", "tiktoken"]
# ``sources[].dtype``: a flat token array's element type (int64 only for a token column).
FlatDtype = Literal["uint16", "uint32", "int32"]
TokenDtype = Literal["uint16", "uint32", "int32", "int64"]
# ``sources[].chat.layout`` / ``chat.train_on`` (plan.chat).
ChatLayout = Literal["messages", "sharegpt", "prompt_completion"]
TrainOn = Literal["assistant", "all", "last_assistant", "completion", "everything"]

ON_ERROR: tuple[OnError, ...] = get_args(OnError)
BALANCE_EFFORTS: tuple[BalanceEffort, ...] = get_args(BalanceEffort)
LONG_DOCUMENTS: tuple[LongDocuments, ...] = get_args(LongDocuments)
MIXING_BY: tuple[MixingBy, ...] = get_args(MixingBy)
MIXING_OVER: tuple[MixingOver, ...] = get_args(MixingOver)
INTERPOLATIONS: tuple[Interpolation, ...] = get_args(Interpolation)
FANOUTS: tuple[Fanout, ...] = get_args(Fanout)
SOURCE_FORMATS: tuple[SourceFormat, ...] = get_args(SourceFormat)
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = get_args(TokenizerKind)
FLAT_DTYPES: tuple[FlatDtype, ...] = get_args(FlatDtype)
TOKEN_DTYPES: tuple[TokenDtype, ...] = get_args(TokenDtype)
CHAT_LAYOUTS: tuple[ChatLayout, ...] = get_args(ChatLayout)
TRAIN_ON: tuple[TrainOn, ...] = get_args(TrainOn)
