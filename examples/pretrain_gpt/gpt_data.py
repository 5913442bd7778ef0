"""pretrain_gpt.py's data: tokenizer, Megatron GPT datasets (train/valid/test) and the per-rank
micro-batch iterators."""

from __future__ import annotations

import math
import os

from gpt_args import _data_prefixes


class TrainerData:
    """The data half of :class:`gpt_trainer.Trainer` (a mixin: it uses the trainer's ``args``,
    ``dp_rank``, ``dp``, ``device``, ``cuda`` and ``log``)."""

    # -- data ------------------------------------------------------------------------------------
    def _build_data(self) -> None:
        from hdet_megatron.megatron import data as D

        args = self.args
        if args.mock_data:
            self.tokenizer = D.ByteLevelTokenizer()
            vocab = args.vocab_size or self.tokenizer.vocab_size
            self.data_meta = {"description": f"MockGPTDataset (vocab {vocab})"}
        else:
            self.tokenizer = D.build_tokenizer(
                args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model
            )
            vocab = self.tokenizer.vocab_size
            prefixes, _ = D.parse_data_path(args.data_path)
            report = D.check_dataset_fits(
                prefixes, args.split, args.seq_length, need_valid=args.eval_iters > 0
            )
            # The test split is optional: evaluated at the end only if it fills a sample.
            self.test_fits = all(c[2]["tokens"] > args.seq_length for c in report)
            metas = [D.read_sidecar(p) or {"prefix": p} for p in prefixes]
            self.data_meta = {
                "description": "; ".join(
                    m.get("description") or os.path.basename(m["prefix"]) for m in metas
                ),
                "documents": sum(m.get("documents", 0) for m in metas),
                "tokens": sum(m.get("tokens", 0) for m in metas),
            }
        self.vocab_size = vocab
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        self.padded_vocab_size = int(math.ceil(vocab / multiple) * multiple)
        gbs = args.global_batch_size
        sizes = [args.train_iters * gbs, max(args.eval_iters, 1) * gbs, max(args.eval_iters, 1) * gbs]
        cache = args.data_cache_path
        if cache is None and not args.mock_data:
            cache = os.path.join(os.path.dirname(os.path.abspath(_data_prefixes(args.data_path)[0])), "cache")
        self.train_ds, self.valid_ds, self.test_ds = D.build_gpt_datasets(
            data_path=args.data_path,
            mock=args.mock_data,
            split=args.split,
            seq_length=args.seq_length,
            seed=args.seed,
            sizes=sizes,
            tokenizer=self.tokenizer,
            cache_path=cache,
        )
        if self.train_ds is None:
            raise D.DataError("the train split is empty; check --split")
        if not getattr(self, "test_fits", True) and self.test_ds is not None:
            self.log(f"test split of --split {args.split} holds less than one sequence; no test evaluation")
            self.test_ds = None

    def _iterator(self, dataset, consumed: int, dp_rank: int | None = None):
        """Micro-batches of ``dataset`` from sample ``consumed`` on, in Megatron's order; the
        slice of DP rank ``dp_rank`` (default: this rank's)."""
        from hdet_megatron.megatron import data as D

        rank = self.dp_rank if dp_rank is None else dp_rank
        sampler = D.PretrainingSampler(len(dataset), consumed, self.args.micro_batch_size, rank, self.dp)
        return D.batch_iterator(dataset, sampler, self.device if self.cuda else None)
