"""The embedded default corpus and prepared-dataset metadata (pure: no torch, no megatron).

The default corpus exists offline on every machine without downloads: the running interpreter's
top-level standard-library modules (``<stdlib>/*.py``, one document per file; on CPython 3.11.7
that is 168 files, 4.7 MB). It is prepared once (byte-level tokens, Megatron indexed dataset)
into ``$HDET_DATA_CACHE`` or ``<repo>/.hdet-cache/data`` (gitignored), keyed by a fingerprint of
the interpreter version and the files' names, sizes and modification times.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig

#: Suffix Megatron's ``tools/preprocess_data.py`` gives a dataset built from the "text" key.
DOCUMENT_SUFFIX = "_text_document"


def default_corpus_files() -> list[str]:
    """The running interpreter's top-level standard-library modules (``<stdlib>/*.py``)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise FileNotFoundError(
            f"no standard-library sources found in {stdlib}; prepare your own corpus with --input"
        )
    return files


def default_corpus_description(files: list[str] | None = None) -> str:
    """One line that names the default corpus: Python version, module count, directory and size."""
    files = files or default_corpus_files()
    size = sum(os.path.getsize(f) for f in files)
    return (
        f"Python {sys.version.split()[0]} standard library, {len(files)} top-level modules "
        f"({os.path.dirname(files[0])}/*.py), {size / 1e6:.1f} MB"
    )


def default_cache_dir() -> str:
    """``$HDET_DATA_CACHE`` or ``<repo>/.hdet-cache/data`` (gitignored)."""
    env = os.environ.get("HDET_DATA_CACHE")
    if env:
        return env
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(repo, ".hdet-cache", "data")


def default_corpus_fingerprint(files: list[str] | None = None) -> str:
    """Short hash of the Python version and each file's name, size and mtime (the cache key)."""
    h = hashlib.sha256(sys.version.encode())
    for f in files or default_corpus_files():
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return h.hexdigest()[:12]


def default_corpus_output_prefix(cache_dir: str | None = None, fingerprint: str | None = None) -> str:
    """Output prefix (without ``_text_document``) of the default corpus in the cache."""
    version = "".join(sys.version.split()[0].split(".")[:2])
    fingerprint = fingerprint or default_corpus_fingerprint()
    return os.path.join(cache_dir or default_cache_dir(), f"stdlib-py{version}-{fingerprint}")


def sidecar_path(prefix: str) -> str:
    """``PREFIX.json``: metadata written next to ``PREFIX.bin/.idx`` by the data-prep tool."""
    return prefix + ".json"


def read_sidecar(prefix: str) -> dict | None:
    """The metadata in ``PREFIX.json`` (see :func:`sidecar_path`), or None if there is none."""
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def cached_default_corpus(cache_dir: str | None = None) -> dict | None:
    """Metadata of the prepared default corpus if it is in the cache and current, else None."""
    fingerprint = default_corpus_fingerprint()
    prefix = default_corpus_output_prefix(cache_dir, fingerprint) + DOCUMENT_SUFFIX
    meta = read_sidecar(prefix)
    if (
        meta
        and meta.get("fingerprint") == fingerprint
        and os.path.isfile(prefix + ".bin")
        and os.path.isfile(prefix + ".idx")
    ):
        return meta
    return None
