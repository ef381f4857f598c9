"""The one-line meaning of each plan field, for ``docs_plan_fields.py``'s table.

Keys are field paths as the parser names them (``sources[].weight``). A value is the meaning,
or a dict with ``meaning`` and, where the parser's own call does not say it, ``type``,
``values`` or ``default`` (a default or range that depends on another field).
"""

from __future__ import annotations

from typing import Any

# section path -> (title, one sentence); "" is the top level
SECTIONS: dict[str, tuple[str, str]] = {
    "": ("Top level", "The plan's identity and the policy for bad records."),
    "sources": (
        "sources",
        "The data sources, one entry each; see [Plans](plans.md#sources) and [Images](images.md).",
    ),
    "tokenizer": ("tokenizer", "How text becomes token ids; see [Plans](plans.md#tokenizer)."),
    "batch": (
        "batch",
        "How each global batch is sized and cut into micro-batches; see [Plans](plans.md#batch).",
    ),
    "layout": ("layout", "The trainer's parallel layout; see [Plans](plans.md#layout)."),
    "mixing": ("mixing", "How sources share each batch; see [Mixing](mixing.md)."),
    "cost": (
        "cost",
        "What a document costs to train on, which the balance evens out; give one form: "
        "coefficients, `model`, `function` or `calibration`. See [Balance](balance.md).",
    ),
    "cost.calibration": (
        "A calibration file",
        "The file that `omniload calibrate` writes and `cost.calibration` names (its own "
        "fields, checked when the plan is read).",
    ),
    "images": (
        "images",
        "How images become patches and placeholder tokens; see [Images](images.md).",
    ),
    "loader": (
        "loader",
        "Tuning: speed and memory, never which samples are delivered; see [Scale](scale.md).",
    ),
    "checkpoint": (
        "checkpoint",
        "The data plane's differential checkpoint; see [Checkpoints](checkpoints.md).",
    ),
    "streams": (
        "streams",
        "Further named streams (validation) served beside training; a stream's `sources` and "
        "`batch` take the fields of the plan's own. See [Streams](streams.md).",
    ),
}

_COEF = "a cost coefficient (time units are yours: only ratios matter)"
_MODEL = {
    "hidden": "hidden size",
    "layers": "transformer layers",
    "heads": {"meaning": "attention heads (required with `kv_heads`)"},
    "kv_heads": "key/value heads (grouped-query attention); must divide `heads`",
    "ffn": "feed-forward width",
    "vocab": {"meaning": "vocabulary size (the output layer's cost)", "default": "unset"},
}


def _model(prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {f"{prefix}": "a transformer described by its shape (Llama-shaped)"}
    for key, meaning in _MODEL.items():
        out[f"{prefix}.{key}"] = meaning
    return out


MEANINGS: dict[str, Any] = {
    "version": "the plan format's version; this release reads 1",
    "name": "the job's name: feeders find the job by it; one job of a name runs on a cluster",
    "seed": "the seed of every shuffle: with the plan, it fixes the stream",
    "on_error": "a bad record or file: `raise` stops the job naming source, file and record; "
    "`skip` skips it and counts it per source",
    "sources": "the list of sources (at most 1,024; at least one with a weight > 0)",
    "sources[].name": "the source's name, unique in the plan (batches and figures carry it)",
    "sources[].format": "`jsonl` (plain, `.gz`, `.zst`), `parquet`, `webdataset` tar shards; "
    "token sources: `megatron` (`.bin`/`.idx`), `arrow` (`save_to_disk` folders), `mds`, `flat`",
    "sources[].path": {
        "type": "string or list of strings",
        "values": "paths or fsspec URLs, globs allowed",
        "meaning": "the files; relative paths are taken from the plan file's folder, "
        "`${VAR}` and `${VAR:-default}` are expanded",
    },
    "sources[].weight": "the source's share of the mix, relative to the others' "
    "(overridden by `mixing.schedule`)",
    "sources[].text": {
        "default": "`text`; `txt` for `webdataset`",
        "meaning": "the JSON key, Parquet column or tar member extension holding the text",
    },
    "sources[].image": {
        "type": "string, or list of extensions",
        "values": "a column name (parquet); extensions such as `[jpg, png]` (webdataset)",
        "default": "none (text only); `[jpg, jpeg, png, webp]` for `webdataset`",
        "meaning": "where a record's images are; makes it an image-text source (with `chat`: "
        "the conversation's images, placed where its turns mark them)",
    },
    "sources[].chat": "makes the source's records conversations rendered with a chat "
    "template (see the chat data guide); unset: plain text, every token a target",
    "sources[].chat.layout": "`messages` (OpenAI `{role, content}` list), `sharegpt` "
    "(`{from, value}` list) or `prompt_completion` (two string fields)",
    "sources[].chat.field": {
        "default": "`messages`; `conversations` for `sharegpt`; `prompt` for `prompt_completion`",
        "meaning": "the record field holding the conversation (or the prompt); `webdataset`: "
        "the key of the record's `.json` file",
    },
    "sources[].chat.completion": "`prompt_completion` only: the record field holding the "
    "completion",
    "sources[].chat.train_on": {
        "default": "`assistant`; `completion` for `prompt_completion`",
        "meaning": "which tokens are targets: `assistant` turns, `all` turns, "
        "`last_assistant`, `completion` or `everything`",
    },
    "sources[].chat.template": {
        "type": "string",
        "meaning": "the chat template's Jinja text; unset with no `template_file`: the "
        "`chat_template` of the `tokenizer_config.json` beside the tokenizer file",
    },
    "sources[].chat.template_file": "a file (path or URL) holding the chat template",
    "sources[].chat.max_tokens": "the longest conversation kept, in tokens; a longer one is a "
    "bad record (never cut); unset: the batch's document cap",
    "sources[].tokens": "token sources: the column of token ids (Arrow, Parquet, MDS); setting "
    "it on a Parquet source makes it a token source",
    "sources[].mask": {
        "type": "section",
        "default": "unset: every token a target",
        "meaning": "token sources with columns (Arrow, Parquet, MDS): a per-token mask column "
        "beside the ids (a pre-tokenized SFT set's `loss_mask` or `labels`), the records' "
        "targets; see the token sources guide",
    },
    "sources[].mask.column": "the mask column: one value per token id of the row",
    "sources[].mask.kind": "`loss_mask` (1/true: a target, 0/false: not) or `labels` "
    "(Hugging Face labels, unshifted: the id itself where a target, `ignore_index` where not)",
    "sources[].mask.ignore_index": "`labels` only: the label of a token that is no target "
    "(negative)",
    "sources[].vocabulary": {
        "type": "section",
        "default": "unset: the plan tokenizer's vocabulary is not checked against the files",
        "meaning": "token sources: the vocabulary the tokens were written with; a size or "
        "special id other than the plan tokenizer's is an error at start and in validate",
    },
    "sources[].vocabulary.size": "the vocabulary size: an id at or above it is a bad record",
    "sources[].vocabulary.bos_id": "the beginning-of-document id the tokens were written with",
    "sources[].vocabulary.eos_id": "the end-of-document id the tokens were written with",
    "sources[].dtype": {
        "default": "`uint16` for `flat`; for `mds`, the column's own type",
        "values": "`uint16`, `uint32`, `int32`; also `int64` for `mds`",
        "meaning": "`flat`: the array's integer type; `mds`: the type of a `bytes` token column",
    },
    "sources[].eod": "`flat` only: the end-of-document id that cuts the array into documents "
    "(kept as each document's last token)",
    "sources[].transform": {
        "type": "string `package.module:function`",
        "meaning": "user code run on each record on the workers: returns the record (changed "
        "or not) or `None` to drop it (counted as `filtered`); see the token sources and user "
        "code guide",
    },
    "sources[].filter": {
        "type": "string `package.module:function`",
        "meaning": "user code run on each record on the workers before `transform`: true keeps "
        "the record, false drops it (counted as `filtered`)",
    },
    "sources[].unit_records": {
        "default": "unset; `64` for `webdataset`",
        "meaning": "records per read unit (Parquet: cuts row groups; tar: records per shard "
        "part); not for `jsonl`",
    },
    "sources[].unit_bytes": "JSON Lines: the byte range of one read unit (compressed files: "
    "of the decompressed stream, at most 16 units a file)",
    "sources[].merge_bytes": "consecutive small files of one unit each are read as one unit "
    "while they add up to this on storage (never more than `unit_bytes`; `0`: every file "
    "alone; not for image sources)",
    "sources[].storage_options": "fsspec options for this source's files; credentials as "
    "`${env:NAME}` (see [Security](security.md#credentials))",
    "sources[].epochs": "stop the source after this many passes; unset: a new epoch with a "
    "fresh shuffle, forever",
    "tokenizer": "the tokenizer section",
    "tokenizer.kind": "`byte` (built in: UTF-8 bytes, BOS 256, EOS 257), `huggingface` "
    "(a tokenizer.json) or `tiktoken` (a BPE file of base64 token / rank lines)",
    "tokenizer.path": {
        "default": "required for `huggingface` and `tiktoken`; not for `byte`",
        "meaning": "the tokenizer file, any fsspec URL",
    },
    "tokenizer.pattern": {
        "default": "required for `tiktoken`; not for other kinds",
        "meaning": "the pre-tokenizer regex published with the BPE file",
    },
    "tokenizer.special_tokens": "`tiktoken` only: special token -> id (they are not in the file)",
    "tokenizer.bos": {
        "type": "string",
        "values": "a token of the tokenizer (`tiktoken`: one of `special_tokens`)",
        "meaning": "the BOS token; required when `add_bos` is true (fixed for `byte`)",
    },
    "tokenizer.eos": {
        "type": "string",
        "values": "a token of the tokenizer (`tiktoken`: one of `special_tokens`)",
        "meaning": "the EOS token; required when `add_eos` is true (fixed for `byte`)",
    },
    "tokenizer.add_bos": {
        "default": "`true` for `byte` or when `bos` is given, else `false`",
        "meaning": "put BOS before each document",
    },
    "tokenizer.add_eos": {
        "default": "`true` for `byte` or when `eos` is given, else `false`",
        "meaning": "put EOS after each document",
    },
    "tokenizer.storage_options": "fsspec options to open the tokenizer file",
    "batch": "the batch section",
    "batch.global_tokens": {
        "default": "`dp * micro_batches * seq_len` (full micro-batches) unless "
        "`global_documents` is given",
        "meaning": "the token budget of one global batch; independent of the DP size",
    },
    "batch.global_documents": "a document count per global batch instead of a token budget",
    "batch.seq_len": {
        "default": "required unless `buckets` is given",
        "meaning": "the token capacity of one packed micro-batch",
    },
    "batch.micro_batches": "micro-batches per rank and step (not with `buckets`)",
    "batch.long_documents": "`split`: cut documents, drop nothing; `truncate`: keep documents "
    "whole, truncated to `seq_len`",
    "batch.max_document_tokens": "`split` only: keep at most this many tokens of a document "
    "(the rest is dropped and counted as truncated); at or under `seq_len`, documents are kept "
    "whole (never cut between micro-batches or steps)",
    "batch.pack_pool": "whole documents and a token budget only: a step's draw packs its "
    "micro-batches best fit decreasing from the next documents of the mix plus this many, and "
    "those left wait for a later step (held in the checkpointed cursors; 0: the in-order draw); "
    "with `buckets`, each document into its bucket's micro-batches, every bucket's oldest "
    "documents first (within half its part of `global_tokens`, which must hold a document of "
    "its `seq_len`)",
    "batch.pad_to_seq_len": "pad every micro-batch to its capacity (fixed shapes); padding is "
    "never a target",
    "batch.buckets": {
        "default": "none: one bucket of `seq_len`",
        "meaning": "context buckets, at most 64, each a micro-batch size of its own",
    },
    "batch.buckets[].seq_len": "this bucket's micro-batch capacity",
    "batch.buckets[].share": {
        "default": "give `share` in every bucket or `micro_batches` in every bucket",
        "values": "> `0` .. `1`; the shares add up to 1",
        "meaning": "the bucket's share of `global_tokens`; micro-batches per rank = "
        "ceil(share * global_tokens / (dp * seq_len))",
    },
    "batch.buckets[].micro_batches": "the bucket's micro-batches per rank and step",
    "batch.buckets[].sources": {
        "type": "list of source names",
        "values": "sources of the plan, each in at most one bucket",
        "meaning": "pin these sources to this bucket whatever their documents' length",
    },
    "layout": "the layout section",
    "layout.dp": "data-parallel groups: each gets its own batch",
    "layout.tp": "tensor-parallel ranks per group: they fetch the same batch",
    "layout.pp": "pipeline-parallel ranks per group: they fetch the same batch",
    "layout.cp": "context-parallel ranks per group: each fetches its zigzag slice",
    "layout.order": {
        "values": "`dp`, `tp`, `pp`, `cp` once each, joined by `-`",
        "meaning": "how global ranks map to coordinates: the first axis varies fastest",
    },
    "layout.balance": "`full`: every pass of the balancer; `fast`: passes 1, 2 and 5 only: dealing "
    "at about a third of the CPU, for a less even split (see "
    "[Balance](balance.md#how-hard-it-balances))",
    "layout.rank_map": {
        "type": "list of `[dp, tp, pp, cp]`",
        "values": "one distinct entry per rank",
        "meaning": "the coordinates of each global rank, instead of `order`",
    },
    "batch.stages": {
        "type": "list of stages",
        "default": "none (one shape for the whole run)",
        "values": "starting in order, each after the one before",
        "meaning": "training stages: from a step on, another budget, `seq_len`, "
        "`micro_batches` or `buckets` (the rest as the batch gives it); see [Stages](stages.md)",
    },
    "batch.stages[].at_step": "the step the stage starts at (give it or `at_tokens`)",
    "batch.stages[].at_tokens": "the stage starts at the first step with this many tokens "
    "drawn before it (needs `global_tokens` and `split` up to there)",
    "streams": {
        "type": "mapping of stream name -> stream",
        "default": "none",
        "meaning": "further streams by name (letters, digits, `_`; not `train`)",
    },
    "streams.<name>": "one further stream: its own sources, batch and passes",
    "streams.<name>.steps": {
        "default": "until every source ends (each needs `epochs`)",
        "meaning": "steps of one pass over the stream",
    },
    "streams.<name>.rotation": "passes before the batches repeat: pass k gives the "
    "(k mod rotation)-th slice of `steps` steps",
    "mixing": "the mixing section",
    "mixing.by": "weights are shares of tokens or of documents",
    "mixing.over": "a schedule's `at` counts steps or consumed tokens",
    "mixing.interpolate": "between schedule points: hold (`constant`) or move linearly",
    "mixing.schedule": {
        "type": "list of `{at, weights}`",
        "values": "`at` increasing",
        "meaning": "weights over the run; without it, the sources' `weight`",
    },
    "mixing.schedule[].at": "where the point starts (steps or tokens, per `over`)",
    "mixing.schedule[].weights": {
        "values": "source -> weight `0` .. `1e+09`, at least one > 0",
        "meaning": "the weights from this point on (sources not named: 0)",
    },
    "cost": "the cost section",
    "cost.linear": _COEF + " per token",
    "cost.quadratic": _COEF + " per token squared (attention)",
    "cost.piece": _COEF + " per document piece (one attention call each)",
    "cost.model": "a transformer described by its shape; the coefficients follow from it",
    **{f"cost.model.{k}": v for k, v in _MODEL.items()},
    "cost.model.gated": "a gated feed-forward (SwiGLU)",
    "cost.model.causal": {"meaning": "causal attention", "default": "`true`"},
    "cost.function": "`package.module:function`: lengths (int64 array) -> costs",
    "cost.calibration": "a calibration file (local, relative to the plan's folder) written by "
    "`omniload calibrate`; only its numbers travel",
    "cost.encoder": {
        "type": "section",
        "default": "none (images cost nothing beside their tokens)",
        "meaning": "a vision encoder's cost per image: coefficients or a `model`",
    },
    "cost.encoder.linear": _COEF + " per image patch",
    "cost.encoder.quadratic": _COEF + " per image patch squared",
    **_model("cost.encoder.model"),
    "cost.calibration.calibration": "what was measured (device, model, sequence length)",
    "cost.calibration.calibration.version": "the calibration format's version",
    "cost.calibration.cost": "the fitted coefficients",
    "cost.calibration.cost.linear": {"default": "required", "meaning": "per token"},
    "cost.calibration.cost.quadratic": {"default": "required", "meaning": "per token squared"},
    "cost.calibration.cost.piece": {"default": "required", "meaning": "per document piece"},
    "cost.calibration.cost.encoder": {
        "type": "section",
        "default": "none",
        "meaning": "the measured encoder terms",
    },
    "cost.calibration.cost.encoder.linear": "per image patch",
    "cost.calibration.cost.encoder.quadratic": "per image patch squared",
    "images": "the images section (read when a source has images)",
    "images.patch_size": "pixels per patch side",
    "images.merge": "`merge` x `merge` patches make one image token",
    "images.min_pixels": {
        "values": "(`patch_size` x `merge`)² .. `2**28`",
        "default": "`3136` (56 x 56), at least (`patch_size` x `merge`)²",
        "meaning": "smaller images are scaled up to this many pixels",
    },
    "images.max_pixels": {
        "values": "`min_pixels` .. `2**28`",
        "default": "`1_003_520` (28 x 28 x 1280), at least `min_pixels`",
        "meaning": "larger images are scaled down to this many pixels, aspect kept",
    },
    "images.max_input_pixels": "an image of more pixels before resizing is a bad record",
    "images.placeholder": {
        "type": "string or integer",
        "values": "a token string or id of the tokenizer; for `byte`, `258` or the text a "
        "chat template writes for an image",
        "default": "required, except `258` for the `byte` tokenizer",
        "meaning": "the token that stands for image tokens in `input_ids`; chat sources with "
        "images need its text with `byte` and `tiktoken` tokenizers (the rendering is cut "
        "there)",
    },
    "loader": "the loader section",
    "loader.workers": "worker processes of the embedded cluster",
    "loader.threads_per_worker": "tokenizing threads per embedded worker (it runs two reads "
    "at once on each)",
    "loader.read_ahead": "read units each source keeps submitted beyond what the steps drawn "
    "ahead need",
    "loader.prefetch": "steps a rank's feeder keeps fetched ahead (at least two blocks when a "
    "task builds several steps)",
    "loader.lookahead": "steps the data plane draws beyond the furthest request",
    "loader.retain_steps": "steps whose recipes are kept so that a restarted rank can fetch "
    "them again",
    "loader.read_retries": "tries of a read cut short or timed out, inside the task",
    "loader.standby": "a standby copy of every upcoming batch and read shard on a second worker",
    "loader.task_seconds": {
        "values": "`0`, or `0.01` .. `600`",
        "meaning": "a read unit measured to take longer is read in portions (`0`: never split)",
    },
    "loader.quotas": "share the read slots among sources by weight x measured cost",
    "loader.reads_per_slot": (
        "reads in flight per read slot of the workers (`reads_per_thread`, its former name, is "
        "still read, with a warning)"
    ),
    "loader.groups_per_task": "DP groups one construction task builds (`0`: about 8 tasks a "
    "step, each of at least 0.5 M tokens)",
    "loader.steps_per_task": "steps one construction task builds when a block holds a whole "
    "step (`0`: about 1 M tokens a task, at most 16)",
    "loader.live_lead": "for a job that expects live changes: draw at most this many steps "
    "past the slowest rank, so that a change takes effect that soon (`0`: no bound; see "
    "[Mixing](mixing.md#how-soon-a-change-takes-effect))",
    "loader.fanout": "who fetches: every rank, one rank per DP group (`broadcast`) or one "
    "agent per node (`node`); see [Scale](scale.md#fan-out)",
    "loader.tls": "run the embedded cluster on TLS with temporary certificates",
    "checkpoint": {
        "type": "section",
        "default": "none (no checkpoint)",
        "meaning": "where and how often the data plane saves its state",
    },
    "checkpoint.url": "a folder, any fsspec URL (relative: from the plan file's folder)",
    "checkpoint.flush_seconds": "deltas are flushed this often, from a thread",
    "checkpoint.compact_every": "a new base snapshot every this many steps",
    "checkpoint.keep_bases": "bases kept (with their deltas): any step since the oldest "
    "can be restored",
    "checkpoint.storage_options": "fsspec options for the checkpoint folder",
}
