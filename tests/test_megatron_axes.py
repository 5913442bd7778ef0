"""Every axis reaches what the forward pass / optimizer really reads, on every arm (TP2 x DP2)."""

from __future__ import annotations

import pytest

from tests.harness import run_world

pytestmark = pytest.mark.slow


def _axes_world(rank, world_size):
    import torch
    import torch.distributed as dist

    from hdet_megatron.config import Axis, HDETConfig
    from hdet_megatron.megatron import toy
    from hdet_megatron.megatron.layout import HDETSetupError
    from hdet_megatron.megatron.runtime import HDET
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
    from hdet_megatron.spread import arm_spread

    out: dict = {"errors": {}}
    setup = toy.ToyGPTSetup(tp=2, hidden_dropout=0.1, attention_dropout=0.2)
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)  # Megatron's standard groups: default, no_wd
        kwargs = toy.scheduler_kwargs(setup, 20)
        state_keys_before = sorted(model[0].state_dict().keys())

        # Bad axes that can only be detected against the real optimizer / model.
        try:
            HDETOptimizerParamScheduler(
                optimizer, hdet=HDETConfig(axes=(Axis("lr:embedding", 0.1),)), **kwargs
            )
        except HDETSetupError as exc:
            out["errors"]["unknown_group"] = str(exc)
        wide = HDETConfig(axes=(Axis("dropout", 0.15),))
        wide_sched = HDETOptimizerParamScheduler(optimizer, hdet=wide, **kwargs)
        try:
            HDET(wide, model, optimizer, wide_sched)
        except HDETSetupError as exc:
            out["errors"]["dropout_range"] = str(exc)

        config = HDETConfig(
            period=2,
            axes=(
                Axis("lr:default", 0.1),
                Axis("lr:no_wd", 0.3),
                Axis("weight_decay", 0.5),
                Axis("dropout", 0.05),
                Axis("attention_temperature", 0.25),
            ),
            auto=False,
        )
        scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
        hdet = HDET(config, model, optimizer, scheduler)
        arm = hdet.layout.arm
        data = toy.data_iterator_for_rank(setup)
        records = []
        for window in range(2):
            spread = arm_spread(config, 2, window)
            assert scheduler.arm_spread_values() == spread
            groups = optimizer.param_groups
            lr_of = {}
            for g in groups:
                name = "no_wd" if g["wd_mult"] == 0.0 else "default"
                base_lr = scheduler.get_lr(g)
                axis = "lr:" + name
                # The param-group entry the optimizer reads: base * scale(1) * rho of this arm.
                assert g["lr"] == base_lr * 1.0 * spread[axis][arm], (axis, g["lr"])
                assert g["weight_decay"] == scheduler.get_wd(g) * g["wd_mult"] * spread["weight_decay"][arm]
                lr_of[name] = g["lr"]
            layers = [m for m in model[0].modules() if hasattr(m, "hidden_dropout")]
            attn = [m for m in model[0].modules() if type(m).__name__ == "DotProductAttention"]
            emb = model[0].module.embedding.embedding_dropout
            hidden = {m.hidden_dropout for m in layers}
            attn_p = {m.attention_dropout.p for m in attn}
            tau = spread["attention_temperature"][arm]
            assert hidden == {0.1 + spread["dropout"][arm]}
            assert attn_p == {0.2 + spread["dropout"][arm]}
            assert emb.p == 0.1 + spread["dropout"][arm]
            base_scale = 1.0 / (setup.hidden_size // setup.num_attention_heads) ** 0.5
            assert {m.softmax_scale for m in attn} == {base_scale / tau}
            records.append(
                {"lr": lr_of, "hidden": hidden.pop(), "attn": attn_p.pop(), "tau": tau, "spread": spread}
            )
            for _ in range(2):  # one window of training, then the next window's values
                losses, _ = toy.train_step(setup, model, optimizer, data)
                scheduler.step(1)
                metrics = hdet.step(losses)
            assert metrics is not None and metrics.arm_values == spread
        out["records"] = records
        out["arm"] = arm
        out["tp_rank"] = dist.get_rank() % 2

        # Attention temperature: the forward pass really uses it (eval mode, no dropout).
        model[0].eval()
        batch = next(toy.synthetic_batches(setup, seed=5))

        def forward():
            with torch.no_grad():
                return model[0](
                    batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"]
                ).clone()

        with_hdet = forward()
        attn = [m for m in model[0].modules() if type(m).__name__ == "DotProductAttention"]
        current_scale = attn[0].softmax_scale
        hdet.close()
        restored = forward()
        for m in attn:
            m.softmax_scale = current_scale  # the same value, set by hand
        by_hand = forward()
        for m in attn:
            m.softmax_scale = base_scale
        out["forward_equal_by_hand"] = torch.equal(with_hdet, by_hand)
        out["forward_differs_restored"] = not torch.equal(with_hdet, restored)
        out["restored"] = {
            "hidden": {m.hidden_dropout for m in model[0].modules() if hasattr(m, "hidden_dropout")},
            "attn": {m.attention_dropout.p for m in attn},
            "emb": model[0].module.embedding.embedding_dropout.p,
            "scale": {m.softmax_scale for m in attn} == {base_scale},
        }
        out["state_keys_same"] = sorted(model[0].state_dict().keys()) == state_keys_before
    return out


def test_axes_reach_forward_and_optimizer_on_every_arm():
    results = run_world(4, _axes_world, timeout=300)
    for r in results:
        assert "no optimizer param group 'embedding'" in r["errors"]["unknown_group"]
        assert "leaves [0, 1)" in r["errors"]["dropout_range"]
        assert r["forward_equal_by_hand"] and r["forward_differs_restored"]
        assert r["restored"] == {"hidden": {0.1}, "attn": {0.2}, "emb": 0.1, "scale": True}
        assert r["state_keys_same"]
    # TP ranks of an arm agree; the two arms differ on every axis with a spread.
    by_arm = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r["records"])
    for recs in by_arm.values():
        assert all(x == recs[0] for x in recs)
    a, b = by_arm[0][0], by_arm[1][0]
    assert a[0]["lr"]["default"] == 0.0  # warm-up starts at 0: window 0 shows no LR spread
    for wa, wb in zip(a[1:], b[1:], strict=True):
        assert wa["lr"]["default"] != wb["lr"]["default"]
        assert wa["lr"]["no_wd"] != wb["lr"]["no_wd"]
    for wa, wb in zip(a, b, strict=True):
        assert wa["hidden"] != wb["hidden"] and wa["tau"] != wb["tau"]
