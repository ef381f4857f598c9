"""What ``omniload validate`` finds in a plan's sources before a job starts.

It lists each source's files (a path that finds none is a problem), runs the start-up checks a
job would run on the first file (a wrong ``text`` field, a missing column, a first line that is
not JSON under ``on_error: raise``), reads the first records of that file, and says which bad
records a job would meet there: under ``on_error: raise`` they would stop it (a problem), under
``skip`` they are skipped and counted (a note). For Parquet sources it says whether the files
carry page checksums, without which a corrupt page that still decodes cannot be seen::

    problem  sources[0].text: source 'web': file '.../a.jsonl': first record has no field ...
    note     sources[1] (books): page checksums in none of its 3 files: a page whose bytes ...

Only the first file of each source is read (and the footers of up to :data:`CHECKSUM_FILES`
Parquet files), so this stays quick on a large corpus; the job's reads find the rest.
"""

from __future__ import annotations

from typing import Any

from omniload_dask.errors import OmniloadError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.files import list_files
from omniload_dask.sources.registry import format_of, get_format

__all__ = ["CHECKSUM_FILES", "PREVIEW_BYTES", "check_source", "check_sources"]

PREVIEW_BYTES = 1 << 18  # of a JSON Lines file's (decompressed) start
PREVIEW_ROWS = 256  # of a Parquet file's first row group
CHECKSUM_FILES = 32
_PREVIEWED = ("jsonl", "parquet")  # (a tar shard is read whole: too much for a check)


def check_sources(plan: Any) -> tuple[list[str], list[str]]:
    """Problems (a job would fail) and notes for every source of ``plan``."""
    problems: list[str] = []
    notes: list[str] = []
    for i, spec in enumerate(plan.sources):
        found, said = check_source(i, spec, plan.on_error)
        problems += found
        notes += said
    return problems, notes


def check_source(index: int, spec: SourceSpec, on_error: str) -> tuple[list[str], list[str]]:
    """Problems and notes for source ``index`` of a plan (see the module docstring)."""
    fmt = format_of(spec)  # (Parquet with a token column has a reader of its own)
    try:
        fs, files, sizes = list_files(spec, fmt)
    except OmniloadError as exc:
        return [f"sources[{index}].path: {exc}"], []
    if spec.format not in _PREVIEWED:
        return [], []
    where = f"sources[{index}] ({spec.name})"
    try:
        units = fmt.units(spec, fs, files[:1], sizes[:1], skip_unreadable=on_error == "skip")
        records = _first_records(spec, fmt, fs, files[0], units.table)
    except OmniloadError as exc:
        field = "text" if "field" in str(exc) or "column" in str(exc) else "path"
        if field == "text" and spec.tokens is not None:
            field = "mask" if "mask column" in str(exc) else "tokens"
        return [f"sources[{index}].{field}: {exc}"], []
    except Exception as exc:  # storage failing under the read: say so, do not crash
        return [f"sources[{index}].path: cannot read {files[0]!r}: {type(exc).__name__}: {exc}"], []
    problems: list[str] = []
    notes: list[str] = []
    if records is not None:
        bad, total = records
        if bad and on_error == "raise":
            offset, reason = bad[0]
            problems.append(
                f"{where}: file {files[0]!r}: record at offset {offset}: {reason}; the job "
                "would stop there (on_error: raise; set on_error: skip to skip and count)"
            )
        elif bad:
            offset, reason = bad[0]
            notes.append(
                f"{where}: {len(bad)} of the first {total} records of {files[0]!r} are bad "
                f"and will be skipped and counted (first: offset {offset}: {reason})"
            )
    if spec.format == "parquet":
        notes.append(_checksum_note(where, get_format("parquet"), fs, files))
    return problems, notes


def _first_records(
    spec: SourceSpec, fmt: Any, fs: Any, url: str, table: Any
) -> tuple[list[tuple[int, str]], int] | None:
    """The bad records among the first records of ``url`` and how many were read."""
    if not len(table):
        return None
    _, start, stop = (int(v) for v in table[0])
    if spec.format == "jsonl":
        stop = PREVIEW_BYTES if stop < 0 or stop - start > PREVIEW_BYTES else stop
    else:
        stop = min(stop, start + PREVIEW_ROWS)
    got = fmt.read(spec, fs, fs._strip_protocol(url), start, stop)
    return got.bad, got.count + len(got.bad)


def _checksum_note(where: str, fmt: Any, fs: Any, files: list[str]) -> str:
    """Which of (the first :data:`CHECKSUM_FILES` of) a Parquet source's files carry page
    checksums, and what that means."""
    checked = files[:CHECKSUM_FILES]
    found = [fmt.checksums(fs, url) for url in checked]
    yes = sum(1 for f in found if f)
    of = f"{len(checked)} files" if len(checked) == len(files) else f"first {len(checked)} files (of {len(files)})"  # fmt: skip
    if yes == len(checked):
        return (
            f"{where}: page checksums in all its {of}: a corrupt page is found and its "
            "rows are bad records (on_error)"
        )
    some = "none" if yes == 0 else f"{yes}"
    return (
        f"{where}: page checksums in {some} of its {of}: in a file without them, a page "
        "whose bytes changed but still decode cannot be told from a good one (write them "
        "with pyarrow's write_page_checksum=True, or parquet-mr's parquet.page.write-checksum.enabled)"
    )
