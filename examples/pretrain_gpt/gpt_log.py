"""pretrain_gpt.py's outputs: progress lines on rank 0 and records in RUN_DIR/metrics.jsonl (run,
step, window, eval, checkpoint, final)."""

from __future__ import annotations

import os
import time
from typing import Any


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class RunLog:
    """What the training loop reports. Steps are buffered (``pending``) and reduced per arm in
    one collective at each log interval or window end (:meth:`flush`, collective); time spent in
    evaluation and checkpointing (:meth:`pause_from`) is left out of tokens/s and the ETA."""

    def __init__(self, tr, args, hdet_config, writer) -> None:
        self.tr, self.args, self.hdet_config = tr, args, hdet_config
        self.write = writer.write if writer else (lambda record: None)
        self.say = tr.log
        self.tokens_per_iter = args.global_batch_size * args.seq_length
        self.signal_name = {"probe": "probe", "line": "line", "average": "avg-line"}.get(
            getattr(hdet_config, "signal", None), "loss"
        )
        self.pending: list[tuple[int, Any, dict]] = []  # (iteration, loss tensor, lr view)
        self.last_loss = float("nan")
        self.paused = 0.0  # seconds spent in evaluation and checkpointing (not in tokens/s and ETA)

    # -- start -------------------------------------------------------------------------------------
    def header(self, writer) -> None:
        """The run's description (rank 0's lines) and its ``run`` record."""
        tr, args, hdet_config, say = self.tr, self.args, self.hdet_config, self.say
        gbs, seq = args.global_batch_size, args.seq_length
        topo = tr._topology()
        say(
            f"GPT {tr.num_params / 1e6:.2f}M params ({args.num_layers} layers, hidden {args.hidden_size}, "
            f"{args.num_attention_heads} heads, seq {seq}, vocab {tr.vocab_size}->{tr.padded_vocab_size}) | "
            f"world {args.world_size} = TP{topo['tp']} x PP{topo['pp']} x DP{topo['dp']} | "
            f"global batch {gbs} ({args.num_microbatches} microbatches of {args.micro_batch_size}/rank) | "
            f"{'device ' + str(tr.device)}"
        )
        say(
            f"data: {tr.data_meta['description']} | "
            f"{'split ' + args.split if not args.mock_data else 'mock splits'}: "
            f"train {len(tr.train_ds)} samples, "
            f"valid {len(tr.valid_ds) if tr.valid_ds is not None else 0}, "
            f"test {len(tr.test_ds) if tr.test_ds is not None else 0}"
        )
        if tr.hdet is not None:
            c = hdet_config
            axes = ", ".join(f"{a.name}:{a.spread:.3g}" for a in c.axes)
            say(
                f"HDET on: {tr.num_arms} arms over DP{tr.dp}, period {c.period}, axes {axes}, "
                f"grad_sync {c.grad_sync}, auto {c.auto} (signal {c.signal}, rule {c.rule}, "
                f"lambda {c.meta_lr}, start scale {c.start_scale:g}, brake {'on' if c.brake else 'off'})"
            )
            # The auto-LR settings and the slow start are said by HDET itself, as on every path
            # (hdet_megatron.window.startup_notice, a warning on rank 0).
            if getattr(args, "hdet_short_run_note", ""):
                say(args.hdet_short_run_note)
        else:
            say("HDET off (--no-hdet): plain Megatron data-parallel training")
        say(
            f"run dir {os.path.abspath(args.run_dir)}"
            + (f" | TensorBoard {writer.tensorboard_dir}" if writer and writer.tensorboard_dir else "")
        )
        self.write(
            {
                "type": "run",
                "iteration": tr.iteration,
                "args": {
                    k: v
                    for k, v in vars(args).items()
                    if isinstance(v, (int, float, str, bool, list, type(None)))
                },
                **topo,
                "world": args.world_size,
                "hdet": hdet_config.fingerprint() if hdet_config else None,
                "num_params": tr.num_params,
                "tokens_per_iter": self.tokens_per_iter,
                "resumed_from": tr.resumed_from,
                "data": tr.data_meta,
                "vocab_size": tr.vocab_size,
                "padded_vocab_size": tr.padded_vocab_size,
                "device": str(tr.device),
            }
        )

    def start_loop(self) -> None:
        """The training loop starts now (tokens/s and ETA count from here)."""
        self.start_iteration = self.tr.iteration
        self.loop_start = time.perf_counter()
        self.last_log_time, self.last_log_iter = self.loop_start, self.tr.iteration

    # -- during training -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Reduce the pending steps' losses per arm (collective), write their records, print one line."""
        import torch

        tr, args, pending = self.tr, self.args, self.pending
        if not pending:
            return
        zero = torch.zeros((), device=tr.device)
        means, per_arm = tr.reduce_per_arm([loss if loss is not None else zero for _, loss, _ in pending])
        now = time.perf_counter()
        steps = pending[-1][0] - self.last_log_iter
        tok_s = self.tokens_per_iter * steps / max(now - self.last_log_time, 1e-9)
        for (it, _, lrs), mean, arms in zip(pending, means, per_arm, strict=True):
            self.write(
                {
                    "type": "step",
                    "iteration": it,
                    "loss": mean,
                    "arm_losses": arms if tr.hdet is not None else None,
                    "tokens_per_s": tok_s,
                    "elapsed_s": now - self.loop_start,
                    "consumed_samples": it * args.global_batch_size,
                    **lrs,
                }
            )
        self.last_loss = means[-1]
        it = pending[-1][0]
        if not args.quiet:
            done = it - self.start_iteration
            eta = (now - self.loop_start - self.paused) / max(done, 1) * (args.train_iters - it)
            lrs = pending[-1][2]
            spread = ""
            if tr.hdet is not None and len(lrs["arm_lrs"]) > 1:
                spread = f" x{lrs['scale']:.3f} (arms {min(lrs['arm_lrs']):.2e}..{max(lrs['arm_lrs']):.2e})"
            self.say(
                f"iter {it:5d}/{args.train_iters} | loss {means[-1]:.4f} | lr {lrs['base_lr']:.3e}{spread} | "
                f"{tok_s:,.0f} tok/s | {_fmt_time(now - tr.t0)} elapsed | ETA {_fmt_time(eta)}"
            )
        pending.clear()
        self.last_log_time, self.last_log_iter = now, it

    def on_window(self, m, lrs) -> None:
        """A converge's ``window`` record and line (``m``: the runtime's WindowMetrics, or None)."""
        if m is None:
            return
        tr, hdet_config = self.tr, self.hdet_config
        record = {
            "type": "window",
            "iteration": tr.iteration,
            "window": m.window,
            "steps": m.steps,
            "arm_losses": m.arm_losses,
            "signal": hdet_config.signal,
            "arm_train_losses": m.arm_train_losses,
            "arm_values": m.arm_values,
            "arm_lrs": lrs["arm_lrs"],
            "base_lr": lrs["base_lr"],
            "scales": m.scales,
            "update": m.update,
            "excluded": m.excluded,
            "converge_seconds": m.converge_seconds,
            "probe_seconds": m.probe_seconds,
            "converge_bytes": m.converge_bytes,
            "converge_bytes_per_step": m.converge_bytes_per_step,
            "grad_bytes_per_step": m.grad_bytes_per_step,
            "forced": m.forced,
        }
        if m.line is not None:
            record["line"] = m.line
        self.write(record)
        if not self.args.quiet:
            arms = " | ".join(
                f"arm{a} lr {lr:.2e} {self.signal_name} {loss:.4f}"
                for a, (lr, loss) in enumerate(zip(lrs["arm_lrs"], m.arm_losses, strict=True))
            )
            before = lrs["scale"]
            after = m.scales.get("lr", before)
            self.say(
                f"converge w{m.window} @ iter {tr.iteration}{' (forced)' if m.forced else ''}: {arms} | "
                f"lr scale {before:.4f} -> {after:.4f} | {m.converge_seconds * 1e3:.1f} ms, "
                f"{m.converge_bytes / 1e6:.2f} MB"
            )

    def pause_from(self, start: float) -> None:
        """Time since ``start`` was spent outside training (evaluation, checkpoint)."""
        spent = time.perf_counter() - start
        self.paused += spent
        self.last_log_time += spent

    def evaluation(self, result: dict, kind: str) -> None:
        """An evaluation's record and line."""
        tr = self.tr
        self.write(result)
        what = (
            "averaged model"
            if result["converged"] and tr.hdet is not None
            else ("each arm's model" if tr.hdet is not None else "model")
        )
        arms = ""
        if tr.hdet is not None and not result["converged"]:
            arms = " | arms " + ", ".join(f"{x:.4f}" for x in result["arm_losses"])
        self.say(
            f"{kind} @ iter {tr.iteration}: loss {result['loss']:.4f} | ppl {result['ppl']:.2f} "
            f"({what}){arms} | {result['seconds']:.1f} s"
        )

    def checkpoint(self, rec: dict) -> None:
        """A saved checkpoint's record and line."""
        self.write(rec)
        self.say(f"saved checkpoint {rec['path']} ({rec['seconds']:.1f} s)")

    # -- end -----------------------------------------------------------------------------------------
    def final(self, train_seconds: float, valid: dict | None, test: dict | None) -> None:
        """The ``final`` record and the closing line."""
        tr, hdet_config, last_loss = self.tr, self.hdet_config, self.last_loss
        wall = time.perf_counter() - tr.t0
        steps_run = tr.iteration - self.start_iteration
        final = {
            "type": "final",
            "iteration": tr.iteration,
            "train_loss": last_loss,
            "valid_loss": valid["loss"] if valid else None,
            "test_loss": test["loss"] if test else None,
            "train_seconds": train_seconds,
            "wall_seconds": wall,
            "steps": steps_run,
            "tokens_per_s": self.tokens_per_iter * steps_run / max(train_seconds, 1e-9),
            "scales": dict(tr.scheduler.controller.scales()) if tr.hdet is not None else None,
        }
        self.write(final)
        self.say(
            f"done: {steps_run} iterations in {_fmt_time(train_seconds)} "
            f"({final['tokens_per_s']:,.0f} tok/s), "
            f"final train loss {last_loss:.4f}"
            + (f", validation loss {valid['loss']:.4f}" if valid else "")
            + (f", test loss {test['loss']:.4f}" if test else "")
            + (
                f", lr scale {tr.scheduler.controller.scale('lr'):.4f}"
                if tr.hdet is not None and hdet_config.axis("lr")
                else ""
            )
            + f" | wall {_fmt_time(wall)}"
        )
