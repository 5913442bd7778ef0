"""Real pretraining data through Megatron-Core's own pipeline.

* Tokenizers: byte-level by default (UTF-8 bytes 0..255, end-of-document id 256; no files, no
  downloads), or GPT-2 BPE / a HuggingFace tokenizer from *local* files when given.
* :func:`prepare_indexed_dataset`: plain-text files / JSONL (``"text"`` field) ->
  Megatron indexed dataset (``<prefix>_text_document.bin/.idx`` written with
  ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``, one document per file or
  JSON line, EOD appended) plus a ``.json`` sidecar describing tokenizer and sources.
* :func:`prepare_default_corpus`: the embedded corpus that exists offline on every machine: the
  running interpreter's top-level standard-library modules (``<stdlib>/*.py``; on CPython 3.11.7
  168 files, 4.7 MB), prepared once and cached (see :mod:`hdet_megatron.corpus`).
* :func:`check_dataset_fits`: clear errors before Megatron sees a split that cannot fill one
  sequence.
* :func:`build_gpt_datasets` / :class:`PretrainingSampler`: train/valid/test splits through
  ``BlendedMegatronDatasetBuilder`` + ``GPTDataset`` and Megatron's pretraining sampler order.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy

from hdet_megatron.corpus import (  # noqa: F401  (re-exported)
    DOCUMENT_SUFFIX,
    cached_default_corpus,
    default_cache_dir,
    default_corpus_description,
    default_corpus_files,
    default_corpus_fingerprint,
    default_corpus_output_prefix,
    read_sidecar,
    sidecar_path,
)
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase

SIDECAR_FORMAT = "hdet-megatron-indexed-dataset/1"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TOKENIZER_TYPES = ("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer")


class DataError(ValueError):
    """Bad data input (missing files, no text, splits too small); the message says what to do."""


# --- tokenizers --------------------------------------------------------------------------------


class ByteLevelTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as tokens (ids 0..255) and an end-of-document token (id 256).

    Unlike ``megatron.core``'s ``ByteLevelTokenizer`` (EOS id 0, PAD id 1, which collide with
    bytes 0 and 1), the special id lies outside the byte range. No padding token: Megatron's
    GPTDataset then pads (only its last validation sample) with an id that never occurs.
    """

    BYTES = 256

    def __init__(self) -> None:
        super().__init__(None, {"library": "byte-level", "type": "ByteLevel"})

    @property
    def vocab_size(self) -> int:
        return self.BYTES + 1

    @property
    def eod(self) -> int:
        return self.BYTES

    @property
    def eos(self) -> int:
        return self.BYTES

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def tokenize_array(self, text: str) -> numpy.ndarray:
        return numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8)

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < self.BYTES).decode("utf-8", errors="replace")

    def vocab(self) -> dict:
        return {bytes([i]): i for i in range(self.BYTES)}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte-level pretraining tokenizer has no chat template")

    def describe(self) -> dict:
        return {"type": "ByteLevel", "vocab_size": self.vocab_size, "eod": self.eod}

    @property
    def unique_identifiers(self) -> dict:
        """Part of the GPTDataset cache key (as in Megatron's text tokenizers)."""
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", **self.describe()}


class HFTokenizer(MegatronTokenizerBase):
    """A ``transformers`` tokenizer loaded from local files only (GPT-2 BPE or any HF dir)."""

    def __init__(self, kind: str, hf_tokenizer, source: dict) -> None:
        super().__init__(None, {"library": "huggingface", "type": kind})
        self._tok = hf_tokenizer
        self._source = source
        eod = hf_tokenizer.eos_token_id
        if eod is None:
            raise DataError(f"{kind}: the tokenizer has no end-of-text (eos) token to separate documents")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def tokenize_array(self, text: str) -> numpy.ndarray:
        return numpy.asarray(self.tokenize(text), dtype=numpy.int64)

    def detokenize(self, ids):
        return self._tok.decode(list(ids))

    def vocab(self):
        return self._tok.get_vocab()

    def apply_chat_template(self, *args, **kwargs):
        return self._tok.apply_chat_template(*args, **kwargs)

    def describe(self) -> dict:
        return {"type": self.type, "vocab_size": self.vocab_size, "eod": self.eod, **self._source}

    @property
    def unique_identifiers(self) -> dict:
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", **self.describe()}


def build_tokenizer(
    tokenizer_type: str = "ByteLevel",
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
) -> MegatronTokenizerBase:
    """The tokenizer named by Megatron-LM style flags. Never downloads anything."""
    if tokenizer_type == "ByteLevel":
        extra = [
            n
            for n, v in (
                ("--vocab-file", vocab_file),
                ("--merge-file", merge_file),
                ("--tokenizer-model", tokenizer_model),
            )
            if v
        ]
        if extra:
            raise DataError(
                f"{', '.join(extra)} given with the byte-level tokenizer; add "
                "--tokenizer-type GPT2BPETokenizer (vocab + merges) or HuggingFaceTokenizer "
                "(--tokenizer-model DIR)"
            )
        return ByteLevelTokenizer()
    if tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type!r}: use one of {', '.join(TOKENIZER_TYPES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, ever
    try:
        import transformers
    except ImportError:
        raise DataError(
            f"--tokenizer-type {tokenizer_type} needs the 'transformers' package "
            "(pip install transformers); the default byte-level tokenizer needs nothing"
        ) from None
    if tokenizer_type == "GPT2BPETokenizer":
        missing = [n for n, v in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if not v]
        if missing:
            raise DataError(
                f"GPT2BPETokenizer needs {' and '.join(missing)} (local GPT-2 vocab.json / merges.txt)"
            )
        assert vocab_file and merge_file  # (missing ones refused just above)
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise DataError(f"{flag} {path}: no such file")
        tok = transformers.GPT2TokenizerFast(vocab_file=vocab_file, merges_file=merge_file)
        return HFTokenizer(
            tokenizer_type,
            tok,
            {"vocab_file": os.path.abspath(vocab_file), "merge_file": os.path.abspath(merge_file)},
        )
    if not tokenizer_model or not os.path.exists(tokenizer_model):
        raise DataError(
            "HuggingFaceTokenizer needs --tokenizer-model pointing to a local tokenizer directory "
            f"(got {tokenizer_model!r}); nothing is downloaded"
        )
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)
    return HFTokenizer(tokenizer_type, tok, {"tokenizer_model": os.path.abspath(tokenizer_model)})


# --- reading a corpus --------------------------------------------------------------------------


@dataclass
class CorpusStats:
    """What a corpus preparation read: files, documents (and empty ones), source bytes."""

    files: int = 0
    documents: int = 0
    empty_documents: int = 0
    source_bytes: int = 0
    file_list: list[str] = field(default_factory=list)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files named by ``inputs``: files, directories (recursively: text and JSONL files) or globs."""
    if not inputs:
        raise DataError(
            "no input given: pass --input FILE|DIR|GLOB (plain text or JSONL) or --default-corpus"
        )
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(root, name)
                for root, _dirs, names in os.walk(item)
                for name in names
                if name.endswith(TEXT_SUFFIXES + JSON_SUFFIXES)
            )
            if not found:
                raise DataError(
                    f"input directory {item!r} holds no text files "
                    f"({', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)})"
                )
            files.extend(found)
        elif os.path.isfile(item):
            files.append(item)
        else:
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise DataError(f"input {item!r}: no such file or directory (and no glob match)")
            files.extend(matched)
    return files


def iter_documents(
    files: Sequence[str],
    json_keys: Sequence[str] = ("text",),
    text_unit: str = "file",
    stats: CorpusStats | None = None,
) -> Iterator[str]:
    """Documents of the corpus: one per JSON line (``json_keys`` concatenated with blank lines),
    and one per text file (``text_unit="file"``) or per blank-line-separated paragraph
    (``"paragraph"``). Whitespace-only documents are skipped (counted in ``stats``)."""
    if text_unit not in ("file", "paragraph"):
        raise DataError(f"text unit {text_unit!r}: use 'file' or 'paragraph'")
    stats = stats if stats is not None else CorpusStats()
    for path in files:
        stats.files += 1
        stats.file_list.append(path)
        stats.source_bytes += os.path.getsize(path)
        docs: Iterable[str]
        if path.endswith(JSON_SUFFIXES):
            docs = _json_documents(path, json_keys)
        else:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            docs = [text] if text_unit == "file" else text.split("\n\n")
        for doc in docs:
            if doc.strip():
                stats.documents += 1
                yield doc
            else:
                stats.empty_documents += 1


def _json_documents(path: str, json_keys: Sequence[str]) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg}); expected one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object with a {json_keys[0]!r} field")
            missing = [k for k in json_keys if k not in record]
            if missing:
                raise DataError(
                    f"{path}:{lineno}: no {missing[0]!r} field (keys: {sorted(record)}); "
                    "choose the text field with --json-keys"
                )
            parts = [record[k] for k in json_keys]
            bad = [k for k, v in zip(json_keys, parts, strict=True) if not isinstance(v, str)]
            if bad:
                raise DataError(f"{path}:{lineno}: field {bad[0]!r} is not a string")
            yield "\n\n".join(parts)


# --- writing an indexed dataset ----------------------------------------------------------------


def prepare_indexed_dataset(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: MegatronTokenizerBase | None = None,
    json_keys: Sequence[str] = ("text",),
    text_unit: str = "file",
    append_eod: bool = True,
    extra_metadata: dict | None = None,
    log=print,
    replaces: Callable[[dict], bool] | None = None,
) -> dict:
    """Tokenize ``inputs`` into ``<output_prefix>_text_document.{bin,idx}`` (+ ``.json``).

    Returns the sidecar metadata (``"prefix"`` is what ``--data-path`` takes). The files are
    written under temporary names and renamed at the end (the sidecar first), so a concurrent
    reader never sees a half-written dataset. An existing file at those names is never
    overwritten (:class:`DataError`), unless its sidecar was written here and ``replaces(sidecar)``
    says this dataset may replace it (the default-corpus cache: an interrupted preparation).
    """
    tokenizer = tokenizer or ByteLevelTokenizer()
    files = expand_inputs(inputs)
    prefix = output_prefix + DOCUMENT_SUFFIX
    _check_not_overwriting(prefix, replaces)
    out_dir = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    stats = CorpusStats()
    tokens = 0
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    try:
        for doc in iter_documents(files, json_keys, text_unit, stats):
            ids = (
                tokenizer.tokenize_array(doc)
                if hasattr(tokenizer, "tokenize_array")
                else numpy.asarray(tokenizer.tokenize(doc))
            )
            if append_eod:
                ids = numpy.concatenate([ids.astype(numpy.int64), [tokenizer.eod]])
            if ids.size == 0:
                continue
            builder.add_document(ids, [int(ids.size)])
            tokens += int(ids.size)
        builder.finalize(tmp + ".idx")
        if stats.documents == 0:
            shown = ", ".join(os.path.basename(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
            raise DataError(
                f"the corpus has no text: read {stats.files} file(s) ({shown}), "
                f"{stats.empty_documents} document(s), all empty or whitespace"
            )
        meta = {
            "format": SIDECAR_FORMAT,
            "prefix": os.path.abspath(prefix),
            "tokenizer": tokenizer.describe()
            if hasattr(tokenizer, "describe")
            else {"vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod},
            "documents": stats.documents,
            "skipped_empty_documents": stats.empty_documents,
            "tokens": tokens,
            "files": stats.files,
            "source_bytes": stats.source_bytes,
            "dtype": numpy.dtype(dtype).name,
            "json_keys": list(json_keys),
            "text_unit": text_unit,
            "append_eod": append_eod,
            "sources": stats.file_list[:50] + ([f"... {stats.files - 50} more"] if stats.files > 50 else []),
            **(extra_metadata or {}),
        }
        # The sidecar first: a .bin/.idx without one was never written here (see replaces).
        with open(tmp + ".json", "w") as fh:
            json.dump(meta, fh, indent=1)
        os.replace(tmp + ".json", sidecar_path(prefix))
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for ext in (".bin", ".idx", ".json"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
    if log:
        log(
            f"[data] {stats.files} file(s), {stats.documents} documents, "
            f"{stats.source_bytes / 1e6:.2f} MB -> {tokens:,} tokens ({meta['tokenizer']['type']}) "
            f"in {prefix}.bin/.idx"
        )
    return meta


def _check_not_overwriting(prefix: str, replaces: Callable[[dict], bool] | None) -> None:
    """Refuse to write over a dataset (or any file) at ``prefix`` that may not be replaced."""
    existing = [p for p in (prefix + ".bin", prefix + ".idx", sidecar_path(prefix)) if os.path.lexists(p)]
    if not existing:
        return
    try:
        with open(sidecar_path(prefix)) as fh:
            old = json.load(fh)
    except (OSError, ValueError):
        old = None
    ours = isinstance(old, dict) and old.get("format") == SIDECAR_FORMAT
    if ours and replaces is not None and replaces(old):
        return
    raise DataError(
        f"{existing[0]} already exists"
        + ("" if ours else " and was not written by prepare_data.py")
        + f": nothing is overwritten; remove {prefix}.{{bin,idx,json}} yourself, or write "
        "elsewhere (another --output-prefix; for the default corpus another HDET_DATA_CACHE / "
        "--cache-dir)"
    )


# --- the embedded default corpus (see hdet_megatron.corpus) ----------------------------------


def prepare_default_corpus(cache_dir: str | None = None, log=print) -> dict:
    """Prepare (once; cached by content fingerprint) the default corpus; returns its metadata."""
    meta = cached_default_corpus(cache_dir)
    if meta is not None:
        if log:
            log(
                f"[data] default corpus (cached): {meta['description']}, {meta['tokens']:,} tokens "
                f"in {meta['prefix']}.bin/.idx"
            )
        return meta
    try:
        files = default_corpus_files()
    except FileNotFoundError as exc:
        raise DataError(str(exc)) from None
    fingerprint = default_corpus_fingerprint(files)
    description = default_corpus_description(files)
    if log:
        log(f"[data] preparing the default corpus: {description}")
    return prepare_indexed_dataset(
        files,
        default_corpus_output_prefix(cache_dir, fingerprint),
        ByteLevelTokenizer(),
        extra_metadata={"fingerprint": fingerprint, "description": description, "default_corpus": True},
        log=log,
        # Only this corpus' own earlier (interrupted) preparation; a file of anyone else's stays.
        replaces=lambda old: old.get("default_corpus") is True and old.get("fingerprint") == fingerprint,
    )


# --- checks before Megatron builds the splits --------------------------------------------------


def parse_data_path(items: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...``."""
    items = list(items)
    if not items:
        raise DataError("--data-path is empty")
    if len(items) == 1:
        return items, None
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
            return items[1::2], weights
        except ValueError:
            pass
    try:
        float(items[0])
    except ValueError:
        return items, None
    raise DataError(f"--data-path {' '.join(items)}: expected PREFIX ... or WEIGHT PREFIX WEIGHT PREFIX ...")


def check_prefix_exists(prefix: str) -> None:
    """Raise :class:`DataError` (with a hint) unless ``PREFIX.bin`` and ``PREFIX.idx`` exist."""
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        hint = ""
        if os.path.isfile(prefix + DOCUMENT_SUFFIX + ".bin"):
            hint = f" (did you mean {prefix + DOCUMENT_SUFFIX}?)"
        raise DataError(
            f"data path {prefix!r} not found: missing {', '.join(missing)}{hint}. Prepare a corpus "
            "with examples/pretrain_gpt/prepare_data.py --input ... --output-prefix PREFIX and pass "
            f"--data-path PREFIX{DOCUMENT_SUFFIX}"
        )


def split_bookends(split: str) -> list[tuple[float, float] | None]:
    """Megatron's ``(begin, end)`` fractions of train/valid/test for ``--split`` (None: empty split)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        vector = parse_and_normalize_split(split)
    except (AssertionError, ValueError, ZeroDivisionError):
        raise DataError(
            f"--split {split!r}: expected up to three non-negative weights 'train,valid,test', e.g. 969,30,1"
        ) from None
    return convert_split_vector_to_split_matrix(vector)


def split_token_counts(prefix: str, split: str) -> list[dict]:
    """Documents and tokens of each split of ``prefix``, split by documents as Megatron does."""
    dataset = IndexedDataset(prefix)
    # Copy: the index is a memory map that closes when ``dataset`` is collected.
    lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)
    del dataset
    n = lengths.shape[0]
    out = []
    for name, bookend in zip(("train", "valid", "test"), split_bookends(split), strict=True):
        if bookend is None:
            out.append({"split": name, "documents": 0, "tokens": 0})
            continue
        beg, end = int(round(bookend[0] * float(n))), int(round(bookend[1] * float(n)))
        out.append({"split": name, "documents": end - beg, "tokens": int(lengths[beg:end].sum())})
    return out


def check_dataset_fits(
    prefixes: Sequence[str], split: str, seq_length: int, need_valid: bool, need_test: bool = False
) -> list[list[dict]]:
    """Raise :class:`DataError` if a split that will be used cannot fill one sequence.

    A GPT sample takes ``seq_length + 1`` consecutive tokens (documents are concatenated), so
    each used split needs at least that many tokens.
    """
    needed = seq_length + 1
    report = []
    for prefix in prefixes:
        check_prefix_exists(prefix)
        counts = split_token_counts(prefix, split)
        report.append(counts)
        for c in counts:
            used = (
                c["split"] == "train"
                or (c["split"] == "valid" and need_valid)
                or (c["split"] == "test" and need_test)
            )
            if not used:
                continue
            if c["documents"] == 0:
                raise DataError(
                    f"{prefix}: the {c['split']} split of --split {split} gets no documents "
                    f"(the corpus has {sum(x['documents'] for x in counts)}); give it a larger share"
                    + (" or pass --eval-iters 0" if c["split"] != "train" else "")
                )
            if c["tokens"] < needed:
                raise DataError(
                    f"--seq-length {seq_length} is longer than the corpus documents allow: the "
                    f"{c['split']} split of {prefix} has {c['tokens']} tokens in {c['documents']} "
                    f"document(s), one sample needs {needed}; use a shorter --seq-length, more data "
                    "or a different --split"
                )
    return report


# --- Megatron datasets and the sampler ---------------------------------------------------------


def build_gpt_datasets(
    *,
    data_path: Sequence[str] | None,
    mock: bool,
    split: str,
    seq_length: int,
    seed: int,
    sizes: Sequence[int],
    tokenizer: MegatronTokenizerBase,
    cache_path: str | None = None,
):
    """(train, valid, test) datasets through ``BlendedMegatronDatasetBuilder``. Collective."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None
    if not mock:
        assert data_path is not None  # callers pass --data-path unless --mock-data
        prefixes, weights = parse_data_path(data_path)
        blend = ([os.path.abspath(p) for p in prefixes], weights)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split if not mock else None,
        path_to_cache=cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if mock else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, config).build()


class PretrainingSampler:
    """Megatron's ``MegatronPretrainingSampler`` order: global batches of consecutive sample
    indices from ``consumed_samples`` on; DP rank ``r`` takes slice ``r`` of each global step's
    ``micro_batch_size * dp_size`` indices (so a resumed run continues with the next sample)."""

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        if consumed_samples >= total_samples:
            raise DataError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.mbs * self.dp_size
        start = self.dp_rank * self.mbs
        for first in range(self.consumed, self.total - step + 1, step):
            yield list(range(first + start, first + start + self.mbs))


def batch_iterator(dataset, sampler: PretrainingSampler, device=None) -> Iterator[dict]:
    """Micro-batches (dicts of stacked tensors) of ``dataset`` in ``sampler`` order."""
    import torch

    for indices in sampler:
        samples = [dataset[i] for i in indices]
        batch = {
            k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        if device is not None:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        yield batch
