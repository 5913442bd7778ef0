"""Data preparation for examples/pretrain_gpt: tokenizer, corpus -> Megatron indexed dataset,
splits, sampler, default corpus cache, and clear errors for bad data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from hdet_megatron import corpus
from hdet_megatron.megatron import data as D

from megatron.core.datasets.indexed_dataset import IndexedDataset

REPO = Path(__file__).resolve().parents[1]
PREPARE = REPO / "examples" / "pretrain_gpt" / "prepare_data.py"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_byte_tokenizer_round_trip_and_special_id():
    tok = D.ByteLevelTokenizer()
    text = "def f(x):\n    return 'héllo' \x00\x01"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text
    assert tok.vocab_size == 257 and tok.eod == 256  # EOD outside the byte range (no collision)
    assert numpy.array_equal(tok.tokenize_array(text), numpy.frombuffer(text.encode(), numpy.uint8))


def test_prepare_text_and_jsonl(tmp_path):
    a = _write(tmp_path / "c" / "a.txt", "first document\n\nstill the first")
    _write(tmp_path / "c" / "sub" / "b.md", "second ü")
    _write(tmp_path / "c" / "empty.txt", "   \n")
    j = _write(
        tmp_path / "d.jsonl",
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["third", "fourth doc", "  "]))
        + "\n",
    )
    meta = D.prepare_indexed_dataset([str(tmp_path / "c"), str(j)], str(tmp_path / "out" / "corp"), log=None)
    prefix = meta["prefix"]
    assert prefix.endswith("corp_text_document")
    assert os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    assert json.load(open(prefix + ".json"))["tokenizer"]["type"] == "ByteLevel"
    assert meta["documents"] == 4 and meta["skipped_empty_documents"] == 2 and meta["files"] == 4
    ds = IndexedDataset(prefix)
    docs = [ds[i].tolist() for i in range(len(ds))]
    texts = ["first document\n\nstill the first", "second ü", "third", "fourth doc"]
    assert docs == [list(t.encode()) + [256] for t in texts]  # sorted dir walk, then the JSONL
    assert meta["tokens"] == sum(len(d) for d in docs)
    assert ds.index.dtype == numpy.uint16
    # paragraph mode splits plain text on blank lines
    meta2 = D.prepare_indexed_dataset([str(a)], str(tmp_path / "para"), text_unit="paragraph", log=None)
    assert meta2["documents"] == 2


def test_corpus_errors_are_clear(tmp_path):
    empty = _write(tmp_path / "empty.txt", " \n\t\n")
    blank = _write(tmp_path / "blank.jsonl", json.dumps({"text": "   "}) + "\n\n")
    with pytest.raises(D.DataError, match="the corpus has no text: read 2 file"):
        D.prepare_indexed_dataset([str(empty), str(blank)], str(tmp_path / "x"), log=None)
    assert not list(tmp_path.glob("x*"))  # nothing half-written left behind
    with pytest.raises(D.DataError, match="no such file or directory"):
        D.prepare_indexed_dataset([str(tmp_path / "missing.txt")], str(tmp_path / "x"), log=None)
    nofield = _write(tmp_path / "nofield.jsonl", json.dumps({"body": "x"}) + "\n")
    with pytest.raises(D.DataError, match=r"nofield.jsonl:1: no 'text' field.*--json-keys"):
        D.prepare_indexed_dataset([str(nofield)], str(tmp_path / "x"), log=None)
    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{not json\n')
    with pytest.raises(D.DataError, match=r"bad.jsonl:2: not valid JSON"):
        D.prepare_indexed_dataset([str(bad)], str(tmp_path / "x"), log=None)
    (tmp_path / "nodocs").mkdir()
    with pytest.raises(D.DataError, match="holds no text files"):
        D.prepare_indexed_dataset([str(tmp_path / "nodocs")], str(tmp_path / "x"), log=None)
    with pytest.raises(D.DataError, match="--vocab-file given with the byte-level tokenizer"):
        D.build_tokenizer("ByteLevel", vocab_file="v.json")


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    docs = [f"document {i}: " + "lorem ipsum dolor sit amet " * (5 + i) for i in range(20)]
    path = _write(tmp / "docs.jsonl", "\n".join(json.dumps({"text": d}) for d in docs))
    meta = D.prepare_indexed_dataset([str(path)], str(tmp / "small"), log=None)
    return meta, docs


def test_split_counts_and_sequence_checks(small_corpus):
    meta, docs = small_corpus
    prefix = meta["prefix"]
    counts = D.split_token_counts(prefix, "80,10,10")
    assert [c["documents"] for c in counts] == [16, 2, 2]
    lengths = [len(d.encode()) + 1 for d in docs]
    assert [c["tokens"] for c in counts] == [sum(lengths[:16]), sum(lengths[16:18]), sum(lengths[18:])]
    D.check_dataset_fits([prefix], "80,10,10", seq_length=64, need_valid=True)
    too_long = counts[1]["tokens"]  # the valid split cannot fill one sample of this length
    with pytest.raises(D.DataError, match="longer than the corpus documents allow: the valid split"):
        D.check_dataset_fits([prefix], "80,10,10", seq_length=too_long, need_valid=True)
    D.check_dataset_fits([prefix], "80,10,10", seq_length=too_long, need_valid=False)  # no eval: fine
    with pytest.raises(D.DataError, match="valid split of --split 100,0,0 gets no documents"):
        D.check_dataset_fits([prefix], "100,0,0", seq_length=16, need_valid=True)
    with pytest.raises(D.DataError, match="not found: missing"):
        D.check_dataset_fits([prefix + "_nope"], "80,10,10", seq_length=16, need_valid=False)


def test_megatron_gpt_dataset_and_sampler(small_corpus, tmp_path):
    meta, docs = small_corpus
    train, valid, test = D.build_gpt_datasets(
        data_path=[meta["prefix"]],
        mock=False,
        split="80,10,10",
        seq_length=32,
        seed=7,
        sizes=[64, 8, 8],
        tokenizer=D.ByteLevelTokenizer(),
        cache_path=str(tmp_path / "cache"),
    )
    assert len(train) >= 64 and len(valid) >= 8 and len(test) >= 8
    sample = train[0]
    assert sample["tokens"].shape == (32,) and torch_equal(sample["tokens"][1:], sample["labels"][:-1])
    text = D.ByteLevelTokenizer().detokenize(sample["tokens"].tolist())
    assert any(part in "".join(docs) for part in text.split("\n") if part)
    # Megatron's sampler order: DP ranks take disjoint slices; resuming continues exactly.
    full = [list(D.PretrainingSampler(64, 0, 2, r, 2)) for r in range(2)]
    assert full[0][0] == [0, 1] and full[1][0] == [2, 3] and full[0][1] == [4, 5]
    assert sorted(i for rank in full for batch in rank for i in batch) == list(range(64))
    assert list(D.PretrainingSampler(64, 8, 2, 1, 2)) == full[1][2:]
    batches = D.batch_iterator(train, D.PretrainingSampler(len(train), 0, 2, 0, 1))
    batch = next(batches)
    assert batch["tokens"].shape == (2, 32) and batch["loss_mask"].shape == (2, 32)


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_default_corpus_is_offline_and_cached(tmp_path, monkeypatch):
    files = corpus.default_corpus_files()
    assert len(files) > 50 and all(f.endswith(".py") for f in files)
    cache = tmp_path / "cache"
    assert corpus.cached_default_corpus(str(cache)) is None
    prepare = _load_prepare_cli()
    assert prepare.main(["--default-corpus", "--cache-dir", str(cache)]) == 0  # prepares (in-process)
    env = dict(os.environ, HDET_DATA_CACHE=str(cache), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(PREPARE), "--default-corpus", "--print-prefix"]
    prefix = corpus.default_corpus_output_prefix(str(cache)) + corpus.DOCUMENT_SUFFIX
    meta = corpus.cached_default_corpus(str(cache))
    assert meta is not None and meta["prefix"] == prefix and meta["documents"] == len(files)
    assert meta["tokens"] == sum(os.path.getsize(f) for f in files) + len(files)
    mtime = os.path.getmtime(prefix + ".bin")
    # The cache hit is answered without importing torch or megatron (a fresh process, fast).
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and second.stdout.strip() == prefix and "(cached)" in second.stderr
    assert os.path.getmtime(prefix + ".bin") == mtime


def _load_prepare_cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", PREPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_cli(tmp_path, capsys):
    prepare = _load_prepare_cli()
    empty = _write(tmp_path / "e.txt", "\n")
    assert prepare.main(["--input", str(empty), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "prepare_data.py: error: the corpus has no text" in capsys.readouterr().err
    assert (
        prepare.main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    )
    assert "no such file or directory" in capsys.readouterr().err
    good = _write(tmp_path / "g.jsonl", json.dumps({"content": "hello world"}) + "\n")
    assert (
        prepare.main(["--input", str(good), "--output-prefix", str(tmp_path / "g"), "--json-keys", "content"])
        == 0
    )
    assert "--data-path" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "g_text_document.idx")


def test_prepared_data_never_overwrites_what_it_did_not_write(tmp_path):
    """An existing dataset or file at the output names stays (issue 27): a stranger's file, an
    earlier dataset at the same prefix, a file in the default corpus' cache slot. Only the
    default corpus' own interrupted preparation (its sidecar, no .idx) is replaced."""
    corpus_file = _write(tmp_path / "c.txt", "hello world")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine_text_document.bin").write_bytes(b"my own data")
    with pytest.raises(D.DataError, match=r"mine_text_document\.bin already exists and was not written by"):
        D.prepare_indexed_dataset([str(corpus_file)], str(out / "mine"), log=None)
    assert (out / "mine_text_document.bin").read_bytes() == b"my own data"
    assert sorted(os.listdir(out)) == ["mine_text_document.bin"]  # no temporary files left
    meta = D.prepare_indexed_dataset([str(corpus_file)], str(out / "ok"), log=None)
    before = {p: open(meta["prefix"] + p, "rb").read() for p in (".bin", ".idx", ".json")}
    with pytest.raises(D.DataError, match=r"ok_text_document\.bin already exists: nothing is overwritten"):
        D.prepare_indexed_dataset([str(_write(tmp_path / "d.txt", "other"))], str(out / "ok"), log=None)
    assert {p: open(meta["prefix"] + p, "rb").read() for p in before} == before
    # An interrupted preparation of this tool: replaced only where the caller allows it.
    os.remove(meta["prefix"] + ".idx")
    again = D.prepare_indexed_dataset(
        [str(corpus_file)], str(out / "ok"), log=None, replaces=lambda old: True
    )
    assert open(again["prefix"] + ".bin", "rb").read() == before[".bin"]
    # The default corpus' cache slot holding a file of someone else's: refused before any work.
    cache = tmp_path / "cache"
    cache.mkdir()
    slot = corpus.default_corpus_output_prefix(str(cache)) + corpus.DOCUMENT_SUFFIX
    with open(slot + ".idx", "wb") as fh:
        fh.write(b"not ours")
    with pytest.raises(D.DataError, match="was not written by prepare_data.py"):
        D.prepare_default_corpus(str(cache), log=None)
    assert open(slot + ".idx", "rb").read() == b"not ours"
