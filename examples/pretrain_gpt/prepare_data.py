r"""Turn a text corpus into a Megatron indexed dataset (``PREFIX_text_document.bin/.idx``).

Inputs: plain-text files (one document per file, or per blank-line paragraph with
``--text-unit paragraph``), JSONL files (one document per line, the ``"text"`` field or
``--json-keys``), directories (searched recursively) or globs. Written with Megatron-Core's
``IndexedDatasetBuilder``, an end-of-document token after every document (as Megatron-LM's
``tools/preprocess_data.py --append-eod``), plus ``PREFIX_text_document.json`` describing the
tokenizer and the sources. Nothing is ever downloaded.

    # your own corpus (byte-level tokenizer by default)
    python examples/pretrain_gpt/prepare_data.py --input corpus/*.jsonl --output-prefix data/my

    # GPT-2 BPE from local vocab/merges files (needs the `transformers` package)
    python examples/pretrain_gpt/prepare_data.py --input corpus/ --output-prefix data/my \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

    # the embedded default corpus (this interpreter's standard library), cached
    python examples/pretrain_gpt/prepare_data.py --default-corpus --print-prefix

Then train with ``--data-path PREFIX_text_document``.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prepare_data.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH", help="text / JSONL files, directories or globs")
    src.add_argument(
        "--default-corpus",
        action="store_true",
        help="the running interpreter's top-level standard-library modules (<stdlib>/*.py)",
    )
    p.add_argument(
        "--output-prefix",
        default=None,
        help="output prefix; files are PREFIX_text_document.{bin,idx,json} "
        "(default for --default-corpus: the cache directory)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache of the default corpus (default $HDET_DATA_CACHE or .hdet-cache/data)",
    )
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL field(s) holding the text")
    p.add_argument(
        "--text-unit",
        choices=("file", "paragraph"),
        default="file",
        help="a plain-text document is a whole file or a blank-line-separated paragraph",
    )
    p.add_argument("--no-append-eod", action="store_true", help="do not append end-of-document tokens")
    p.add_argument(
        "--tokenizer-type",
        default="ByteLevel",
        choices=("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer"),
    )
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-model", default=None, help="local HuggingFace tokenizer directory")
    p.add_argument(
        "--print-prefix", action="store_true", help="print only the --data-path value on stdout (for scripts)"
    )
    return p


def _show(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    log = (lambda msg: print(msg, file=sys.stderr)) if args.print_prefix else print
    if args.default_corpus and args.tokenizer_type == "ByteLevel" and not args.output_prefix:
        # Cache hit: answer without importing torch/megatron (seconds saved on every demo run).
        from hdet_megatron.corpus import cached_default_corpus

        meta = cached_default_corpus(args.cache_dir)
        if meta is not None:
            log(
                f"[data] default corpus (cached): {meta['description']}, {meta['tokens']:,} tokens "
                f"in {meta['prefix']}.bin/.idx"
            )
            print(meta["prefix"] if args.print_prefix else f"--data-path {_show(meta['prefix'])}")
            return 0
    from hdet_megatron.megatron import data as D  # applies the CPU shims before megatron.core

    try:
        if args.default_corpus:
            if args.tokenizer_type != "ByteLevel" or args.output_prefix:
                raise D.DataError(
                    "--default-corpus is prepared with the byte-level tokenizer into the "
                    "cache; drop --tokenizer-type/--output-prefix (or use --input)"
                )
            meta = D.prepare_default_corpus(args.cache_dir, log=log)
        else:
            if not args.output_prefix:
                raise D.DataError("--output-prefix is required with --input")
            tokenizer = D.build_tokenizer(
                args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model
            )
            meta = D.prepare_indexed_dataset(
                args.input,
                args.output_prefix,
                tokenizer,
                json_keys=args.json_keys,
                text_unit=args.text_unit,
                append_eod=not args.no_append_eod,
                log=log,
            )
    except D.DataError as exc:
        print(f"prepare_data.py: error: {exc}", file=sys.stderr)
        return 2
    if args.print_prefix:
        print(meta["prefix"])
    else:
        print(f"--data-path {_show(meta['prefix'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
