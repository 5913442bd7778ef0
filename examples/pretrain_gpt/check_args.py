r"""Check a training command line once, before ``torchrun`` starts any rank.

The launch scripts (``demo_cpu.sh``, ``run_multinode.sh``, ``pretrain_gpt.sbatch``,
``pretrain_gpt_hdet.sh``) run this with the world size they are about to launch, so that a bad
flag or file is one line and exit code 2 instead of one error per rank inside torchrun's
``ChildFailedError`` banner::

    python examples/pretrain_gpt/check_args.py --world-size 4 --defaults K [--print0] -- \
        DEFAULT_1 ... DEFAULT_K USER_ARGS...

* The first ``K`` tokens after ``--`` are the launcher's defaults; the rest are the user's
  flags, which win: a default is dropped when the user gives the same flag, or one that
  replaces it (``--hdet-axis`` replaces ``--hdet-spread``, ``--no-hdet`` every ``--hdet-*``
  default, ``--mock-data`` the data flags; :func:`hdet_megatron.preflight.merge_defaults`).
* ``--script pretrain_gpt.py`` (default) checks with that script's own validation (every check
  that needs no process group: sizes vs. the world, data files, checkpoints in ``--load``, a run
  directory of another job); ``--script pretrain_gpt_hdet.py`` runs Megatron-LM's
  ``parse_args``/``validate_args`` (patched ``megatron.training``) plus the HDET checks.
* ``--data-path @default-corpus`` among the defaults stands for the demo's corpus: checked
  against the cached copy, or a stand-in when it is not prepared yet (the launcher prepares it
  after the flags passed, so a typo costs no corpus preparation).
* ``--fresh``: the launcher empties ``--save`` before training (the demo: a previous demo run
  only), so its old contents are not checked against this run (other directories still are).
* ``--print0``: on success, print the merged argument list NUL-separated on stdout.

Exit codes: 0 ok, 2 bad flag or file (one line on stderr: ``PROG: error: WHAT: FIX``).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

try:
    from hdet_megatron.preflight import (  # noqa: E402
        InputError,
        OneLineParser,
        check_checkpoint,
        check_save_dir,
        fail,
        fresh_run_dir,
        integer,
        merge_defaults,
    )
except ImportError as _exc:  # the launcher's PYTHON is not the project's environment
    print(
        f"check_args.py: error: {sys.executable} cannot import hdet_megatron ({_exc}): set PYTHON "
        "(or VENV) to the environment of `pip install -e .` / `make setup`",
        file=sys.stderr,
    )
    sys.exit(2)

PROG = "check_args.py"
DEFAULT_CORPUS = "@default-corpus"
#: Defaults of pretrain_gpt_hdet.py's call to Megatron-LM's parse_and_validate_args.
MEGATRON_ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


# --- pretrain_gpt.py ----------------------------------------------------------------------------


def _args_module():
    """The module with pretrain_gpt.py's ``parse_args`` and ``UsageError`` (no torch import)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    try:
        import gpt_args as module  # the argument half of pretrain_gpt.py
    except ImportError:
        import pretrain_gpt as module
    return module


def check_pretrain_gpt(argv: Sequence[str], world_size: int, fresh: bool = False):
    """``pretrain_gpt.py``'s validation for ``world_size`` ranks. Returns ``(args, hdet_config)``;
    raises :class:`InputError` with the script's message. Notes it prints are swallowed."""
    module = _args_module()
    notes = io.StringIO()
    try:
        with contextlib.redirect_stderr(notes), fresh_run_dir(fresh):
            return module.parse_args(list(argv), world_size=world_size)
    except module.UsageError as exc:
        raise InputError(str(exc)) from None


# --- pretrain_gpt_hdet.py (Megatron-LM's own arguments) -------------------------------------------


#: Hints for Megatron-LM messages that do not say what to change (substring -> fix).
_MEGATRON_HINTS = (
    (
        "total_model_size",
        "launch a multiple of TP x PP (x CP) ranks, or change "
        "--tensor-model-parallel-size / --pipeline-model-parallel-size",
    ),
    ("batch_size", "--global-batch-size must be a multiple of --micro-batch-size x DP"),
    ("max_position_embeddings", "raise --max-position-embeddings or lower --seq-length"),
)


def _flags(text: str) -> str:
    """``args.hidden_size`` -> ``--hidden-size`` (Megatron's source names its flags so)."""
    import re

    return re.sub(r"\bargs\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), text)


def _assertion_text(exc: AssertionError) -> str:
    """Megatron's ``assert cond, msg``: the message (with a hint), else the failed condition."""
    import traceback

    message = str(exc).strip()
    if message:
        hint = next((fix for key, fix in _MEGATRON_HINTS if key in message), None)
        return f"{message.rstrip('.')}" + (f": {hint}" if hint else " (Megatron-LM's argument check)")
    frames = traceback.extract_tb(exc.__traceback__)
    frame = frames[-1] if frames else None
    if frame is None or not frame.line:
        return "a Megatron-LM argument check failed; see megatron/training/arguments.py"
    condition = frame.line.strip()
    condition = condition[len("assert ") :] if condition.startswith("assert ") else condition
    return (
        f"Megatron-LM requires {_flags(condition)} ({os.path.basename(frame.filename)}:"
        f"{frame.lineno}): change those flags"
    )


def check_megatron(
    argv: Sequence[str],
    world_size: int,
    prog: str = "pretrain_gpt_hdet.py",
    args_defaults: dict | None = None,
):
    """Megatron-LM's ``parse_args`` + ``validate_args`` for ``world_size`` ranks (no process
    group, no tokenizer, no global state), then the HDET flags (``--hdet-*`` of the patch) and
    the files (``--load``, ``--data-path``, vocabulary). Call after ``megatron.training`` is
    importable (CPU shims applied). Returns the args; raises :class:`InputError`."""
    import argparse

    from hdet_megatron.config import HDETConfigError
    from hdet_megatron.megatron import training_hooks

    import megatron.training.arguments as arguments

    def error(self, message):
        raise InputError(f"{message} ({prog} --help lists the flags)")

    saved = (sys.argv, argparse.ArgumentParser.error, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")})
    sys.argv = [prog, *argv]
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0")
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            try:
                args = arguments.parse_args()
                arguments.validate_args(args, dict(args_defaults or MEGATRON_ARGS_DEFAULTS))
            except InputError:
                raise
            except AssertionError as exc:
                raise InputError(_assertion_text(exc)) from None
            except (ValueError, TypeError, KeyError, NotImplementedError, RuntimeError) as exc:
                raise InputError(f"{type(exc).__name__} in Megatron-LM's argument checks: {exc}") from None
    finally:
        sys.argv, argparse.ArgumentParser.error = saved[0], saved[1]
        for key, value in saved[2].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        config = training_hooks.config_from_args(args)
    except HDETConfigError as exc:
        raise InputError(str(exc)) from None
    dp = int(getattr(args, "data_parallel_size", 0) or 0)
    if config is not None and dp:
        arms = config.arms or dp
        if dp % arms:
            raise InputError(
                f"--hdet-arms {arms} must divide the data-parallel size {dp} (world {world_size} / "
                f"TP {args.tensor_model_parallel_size} / PP {args.pipeline_model_parallel_size}); "
                f"use one of {[a for a in range(1, dp + 1) if dp % a == 0]}"
            )
        if config.signal in ("line", "average") and arms < 3:
            # The controller refuses it too (a line fit needs >= 3 points), only after start-up.
            raise InputError(
                f"--hdet-signal {config.signal} fits the update line at the arms' multipliers and "
                f"needs >= 3 arms, this run has {arms} (data-parallel size {dp}); use "
                "--hdet-signal probe (or train), or more data-parallel ranks"
            )
    _check_megatron_files(args)
    return args


def _check_megatron_files(args) -> None:
    if getattr(args, "load", None):
        check_checkpoint(args.load, getattr(args, "ckpt_step", None) or None)
    if getattr(args, "save", None):
        # Megatron-LM's save_checkpoint would write among another run's checkpoints and point
        # the tracker at its own: the same rule as pretrain_gpt.py (continue it with --load).
        check_save_dir(args.save, getattr(args, "load", None), getattr(args, "ckpt_step", None) or None)
    for flag in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(args, flag, None)
        if path and not os.path.exists(path):
            raise InputError(
                f"--{flag.replace('_', '-')} {path}: no such file; give the tokenizer's "
                f"{flag.split('_')[-1]} file (e.g. gpt2-{'vocab.json' if 'vocab' in flag else 'merges.txt'})"
            )
    if getattr(args, "mock_data", False):
        return
    paths = list(getattr(args, "data_path", None) or [])
    if len(paths) > 1 and len(paths) % 2 == 0:
        try:
            [float(w) for w in paths[0::2]]
            paths = paths[1::2]
        except ValueError:
            pass
    for prefix in paths:
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise InputError(
                f"--data-path {prefix}: missing {', '.join(missing)}; prepare the corpus "
                "with examples/pretrain_gpt/prepare_data.py and pass PREFIX_text_document"
            )


def _load_hdet_script():
    """Import pretrain_gpt_hdet.py (CPU shims, megatron.training) and require the patch."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import pretrain_gpt_hdet as script  # noqa: PLC0415

    if not hasattr(script._mtraining, "_hdet_hooks"):
        raise InputError(script.PATCH_HINT)
    return script


# --- the launcher's command line ----------------------------------------------------------------


@contextlib.contextmanager
def _default_corpus(argv: list[str]):
    """Resolve ``--data-path @default-corpus``: the cached prefix, or a stand-in (empty files
    with the corpus' ByteLevel sidecar) while it is not prepared. Yields the argv to check."""
    if DEFAULT_CORPUS not in argv:
        yield argv
        return
    from hdet_megatron.corpus import cached_default_corpus

    meta = cached_default_corpus()
    if meta:
        yield [meta["prefix"] if a == DEFAULT_CORPUS else a for a in argv]
        return
    with tempfile.TemporaryDirectory(prefix="hdet-check-") as tmp:
        prefix = os.path.join(tmp, "default_corpus_text_document")
        for ext in (".bin", ".idx"):
            open(prefix + ext, "wb").close()
        with open(prefix + ".json", "w") as fh:
            fh.write('{"tokenizer": {"type": "ByteLevel"}}')
        yield [prefix if a == DEFAULT_CORPUS else a for a in argv]


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=integer(1), required=True, help="ranks the launcher will start")
    p.add_argument("--script", choices=("pretrain_gpt.py", "pretrain_gpt_hdet.py"), default="pretrain_gpt.py")
    p.add_argument("--defaults", type=integer(0), default=0, help="how many leading ARGS are defaults")
    p.add_argument("--fresh", action="store_true", help="the launcher empties --save first")
    p.add_argument("--print0", action="store_true", help="print the merged ARGS NUL-separated")
    p.add_argument("--prog", default=None, help="name in the error line (default: --script)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1 :]
    else:
        own, rest = argv, []
    opts = build_parser().parse_args(own)
    prog = opts.prog or opts.script
    if opts.defaults > len(rest):
        return fail(PROG, f"--defaults {opts.defaults} exceeds the {len(rest)} arguments after --")
    merged = merge_defaults(rest[: opts.defaults], rest[opts.defaults :])
    try:
        with _default_corpus(merged) as checked:
            if opts.script == "pretrain_gpt.py":
                check_pretrain_gpt(checked, opts.world_size, fresh=opts.fresh)
            else:
                _load_hdet_script()
                check_megatron(checked, opts.world_size, prog=prog)
    except InputError as exc:
        return fail(prog, str(exc))
    if opts.print0:
        sys.stdout.write("".join(a + "\0" for a in merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
