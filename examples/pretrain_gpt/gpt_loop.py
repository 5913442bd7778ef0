"""pretrain_gpt.py's training loop: steps, converges, periodic checkpoints and evaluations, the
final averaged model."""

from __future__ import annotations

import time

from gpt_log import RunLog
from gpt_trainer import Trainer


def train(args, hdet_config, liveness=None) -> int:
    from hdet_megatron.metrics import MetricsWriter

    tr = Trainer(args, hdet_config)
    if liveness is not None:  # hdet_megatron.liveness: its line says where training was
        liveness.status = lambda: f"at iteration {tr.iteration}"
    writer = None
    if tr.rank == 0:
        writer = MetricsWriter(args.run_dir, False if args.no_tensorboard else args.tensorboard_dir)
    log = RunLog(tr, args, hdet_config, writer)
    log.header(writer)

    train_iter = tr._iterator(tr.train_ds, tr.consumed_train_samples)
    log.start_loop()
    last_lrs = tr.lr_view()

    def do_eval(kind: str = "valid", dataset=None) -> dict | None:
        t = time.perf_counter()
        result = tr.evaluate(tr.valid_ds if dataset is None else dataset, kind)
        log.pause_from(t)
        if result is not None:
            log.evaluation(result, kind)
        return result

    def do_save() -> None:
        log.flush()
        t = time.perf_counter()
        rec = tr.save()
        log.pause_from(t)
        log.on_window(rec.pop("window"), last_lrs)
        log.checkpoint(rec)

    valid = None
    while tr.iteration < args.train_iters:
        lrs = tr.lr_view()  # the LRs this iteration's update uses
        loss, window = tr.train_step(train_iter)
        tr.iteration += 1
        log.pending.append((tr.iteration, loss, lrs))
        last_lrs = lrs
        if window is not None or tr.iteration % args.log_interval == 0 or tr.iteration == args.train_iters:
            log.flush()
        log.on_window(window, lrs)
        # Save before evaluating: the save converges (HDET), so validation then sees the
        # averaged model.
        if (
            args.save
            and args.save_interval
            and tr.iteration % args.save_interval == 0
            and tr.iteration < args.train_iters
        ):
            do_save()
        if args.eval_iters and tr.iteration % args.eval_interval == 0 and tr.iteration < args.train_iters:
            valid = do_eval()

    log.flush()
    train_seconds = time.perf_counter() - log.loop_start - log.paused
    # End of training: the final model is the averaged one.
    if tr.hdet is not None:
        log.on_window(tr.hdet.converge(), last_lrs)
    valid = do_eval() or valid
    if args.save and tr.iteration > (tr.resumed_from or 0):
        do_save()
    test = do_eval("test", tr.test_ds) if tr.test_ds is not None else None
    log.final(train_seconds, valid, test)
    if tr.hdet is not None:
        tr.hdet.close()
    if writer:
        writer.close()
    if liveness is not None:  # past the last collective: peers may exit from here on
        liveness.stop()
    tr.ps.destroy_model_parallel()
    return 0
