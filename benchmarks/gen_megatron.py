"""The Megatron example with one benchmark-only change: a peer optimizer, or a controller prototype.

    torchrun --nproc-per-node 4 benchmarks/gen_megatron.py --peer sf --peer-warmup 8 -- \
        <pretrain_gpt.py flags, with --no-hdet>
    torchrun --nproc-per-node 4 benchmarks/gen_megatron.py --prototype NAME -- \
        <pretrain_gpt.py flags with HDET>

Runs ``examples/pretrain_gpt/pretrain_gpt.py``'s ``main`` unchanged except for one thing.

``--prototype NAME`` (repeatable) switches on one of the controller's prototypes
(``hdet_megatron.controller.PROTOTYPES``) in this process: measured on the example without a
product flag for it.

``--peer``: the torch optimizer that Megatron-Core's ``get_megatron_optimizer`` wraps
(``torch.optim.AdamW`` on CPU) is replaced, after Megatron built it, by the peer over the same
parameter groups (so Megatron's gradient clipping, its fp32 wrapper and its LR scheduler stay as
they are):

- ``sf``: ``schedulefree.AdamWScheduleFree(lr=--lr, warmup_steps=--peer-warmup)``; give the
  example ``--lr-decay-style constant --lr-warmup-iters 0`` so Megatron's scheduler holds the LR
  and the warm-up is Schedule-Free's own (its docs). Switched to ``.eval()`` around every
  evaluation (the averaged iterate) and back to ``.train()`` after.
- ``prodigy``: ``prodigyopt.Prodigy(lr=1, safeguard_warmup=True)``; give the example ``--lr 1``
  and the task's schedule: Megatron's scheduler then multiplies Prodigy's adapted step by the
  schedule's shape.

A peer runs only plain Megatron (``--no-hdet``) with the non-distributed optimizer (both
checked). The product is not touched: the swap lives in this process only. The run directory
gets ``peer.json`` naming the optimizer that trained, so a result cannot silently come from AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt")


def build_peer(name: str, inner, warmup: int):
    """The peer optimizer over ``inner``'s parameter groups (Megatron's keys kept per group)."""
    groups = [dict(g) for g in inner.param_groups]
    if name == "sf":
        try:
            from schedulefree import AdamWScheduleFree
        except ImportError as exc:
            raise SystemExit("--peer sf needs the 'schedulefree' package: pip install -e '.[bench]'") from exc
        for g in groups:  # AdamW's own keys that Schedule-Free does not take
            for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"):
                g.pop(key, None)
        lr = groups[0]["lr"]
        peer = AdamWScheduleFree(groups, lr=lr, warmup_steps=warmup)
        peer.train()
        return peer
    try:
        from prodigyopt import Prodigy
    except ImportError as exc:
        raise SystemExit("--peer prodigy needs the 'prodigyopt' package: pip install -e '.[bench]'") from exc
    for g in groups:
        for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"):
            g.pop(key, None)
    return Prodigy(groups, lr=1.0, safeguard_warmup=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=("sf", "prodigy"), default=None)
    p.add_argument("--peer-warmup", type=int, default=0, help="Schedule-Free's warmup_steps")
    p.add_argument("--prototype", action="append", default=[], help="controller prototype to switch on")
    p.add_argument("example_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    argv = [a for a in args.example_args if a != "--"]
    if (args.peer is None) == (not args.prototype):
        raise SystemExit("give exactly one of --peer and --prototype")
    if args.peer and ("--no-hdet" not in argv or "--use-distributed-optimizer" in argv):
        raise SystemExit(
            "a peer optimizer runs plain Megatron: give --no-hdet, no --use-distributed-optimizer"
        )
    sys.path.insert(0, EXAMPLE)
    import gpt_trainer
    import pretrain_gpt

    if args.prototype:
        if "--no-hdet" in argv:
            raise SystemExit("--prototype needs an HDET run (no --no-hdet)")
        switch_on_prototypes(args.prototype)
        return finish(pretrain_gpt.main(argv))

    import hdet_megatron.megatron  # noqa: F401  (the CPU shims megatron.core needs, first)

    import megatron.core.optimizer as mopt

    original = mopt.get_megatron_optimizer
    peers: list = []  # the peer optimizers that train (one per Megatron wrapper)

    def get_megatron_optimizer(config, model, *a, **kw):
        opt = original(config, model, *a, **kw)
        # Megatron-Core 0.19 returns a ChainedOptimizer over one fp32 wrapper per group of params.
        for sub in getattr(opt, "chained_optimizers", [opt]):
            if type(sub.optimizer).__name__ != "AdamW":
                raise SystemExit(f"expected Megatron to wrap torch AdamW, got {type(sub.optimizer).__name__}")
            sub.optimizer = build_peer(args.peer, sub.optimizer, args.peer_warmup)
            peers.append(sub.optimizer)
        return opt

    mopt.get_megatron_optimizer = get_megatron_optimizer
    evaluate = gpt_trainer.Trainer.evaluate

    def evaluate_in_eval_mode(self, dataset, kind):
        for peer in peers:
            if hasattr(peer, "eval"):
                peer.eval()  # Schedule-Free: evaluate the averaged iterate
        try:
            return evaluate(self, dataset, kind)
        finally:
            for peer in peers:
                if hasattr(peer, "train"):
                    peer.train()

    gpt_trainer.Trainer.evaluate = evaluate_in_eval_mode
    code = pretrain_gpt.main(argv)
    run_dir = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else None
    if code == 0 and run_dir and int(os.environ.get("RANK", "0")) == 0:
        record = {"optimizers": [type(p).__name__ for p in peers]}
        if args.peer == "prodigy":  # Prodigy's adapted step size d at the end, per optimizer
            record["d"] = [p.param_groups[0].get("d") for p in peers]
        with open(os.path.join(run_dir, "peer.json"), "w") as f:
            json.dump(record, f)
    return finish(code)


def switch_on_prototypes(names: list[str]) -> None:
    """Switch the named controller prototypes on in this process (unknown names refused)."""
    from hdet_megatron import controller

    unknown = set(names) - controller.KNOWN_PROTOTYPES
    if unknown:
        raise SystemExit(
            f"unknown --prototype {sorted(unknown)}; known: {sorted(controller.KNOWN_PROTOTYPES)}"
        )
    controller.PROTOTYPES.update(names)


def finish(code: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        return code
    os._exit(0)  # as pretrain_gpt.py's __main__: skip finalization (gloo threads, see there)


if __name__ == "__main__":
    sys.exit(main())
