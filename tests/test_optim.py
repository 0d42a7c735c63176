"""Optimizer hyper-parameters come from the config; the schedule is warmup + decay."""

import math

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.training.optim import LRSchedule, build_optimizer, lr_at, rescaled


def test_optimizer_uses_configured_hyperparameters():
    cfg = load_config(None, ["training.lr=3e-4", "training.betas=[0.8, 0.95]",
                             "training.eps=1e-6", "training.weight_decay=0.01"]).training
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model.parameters(), cfg)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.95)
    assert group["eps"] == 1e-6
    assert group["weight_decay"] == 0.01
    LRSchedule(opt, total_steps=100, cfg=cfg)  # sets the first warmup LR
    assert group["lr"] == pytest.approx(3e-4 / 4)  # first of 4 warmup steps


def test_reference_defaults_reach_the_optimizer():
    cfg = load_config().training
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    group = opt.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-8, 0.0)


def test_warmup_then_cosine_to_zero():
    cfg = load_config().training  # lr 6e-4, warmup 4%
    total = 1000
    lrs = [lr_at(s, total_steps=total, cfg=cfg) for s in range(total)]
    assert lrs[0] == pytest.approx(6e-4 / 40)
    assert lrs[39] == pytest.approx(6e-4)
    assert max(lrs) == pytest.approx(6e-4)
    mid = 40 + (total - 40) // 2
    assert lrs[mid] == pytest.approx(3e-4, rel=1e-2)
    assert lrs[-1] < 1e-8 + 6e-4 * (1 - math.cos(math.pi / 960)) and lrs[-1] >= 0
    assert all(a >= b for a, b in zip(lrs[40:], lrs[41:]))


def test_warmup_steps_replace_the_ratio():
    cfg = load_config(None, ["training.warmup_steps=10", "training.schedule=constant", "training.lr=3e-3"]).training
    lrs = [lr_at(s, total_steps=10**6, cfg=cfg) for s in range(12)]
    assert lrs[0] == pytest.approx(3e-4) and lrs[9] == pytest.approx(3e-3) and lrs[11] == pytest.approx(3e-3)
    none = load_config(None, ["training.warmup_steps=0"]).training
    assert lr_at(0, total_steps=100, cfg=none) == pytest.approx(none.lr)


def test_wsd_holds_the_lr_then_decays_over_the_last_fraction():
    cfg = load_config(None, ["training.warmup_steps=10", "training.schedule=wsd", "training.lr=1e-3",
                             "training.decay_ratio=0.2"]).training
    lrs = [lr_at(s, total_steps=110, cfg=cfg) for s in range(110)]
    # 100 steps after warmup: the last 20 decay linearly to min_lr (0), the rest hold lr.
    assert lrs[9] == pytest.approx(1e-3) and all(lr == pytest.approx(1e-3) for lr in lrs[10:91])
    assert lrs[100] == pytest.approx(1e-3 * 0.5) and lrs[109] == pytest.approx(1e-3 / 20)
    assert all(a > b for a, b in zip(lrs[90:], lrs[91:]))
    with pytest.raises(ConfigError, match="training.decay_ratio must be in"):
        load_config(None, ["training.decay_ratio=0"])


def test_schedule_state_round_trip():
    cfg = load_config().training
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    sched = LRSchedule(opt, total_steps=50, cfg=cfg)
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    sched2 = LRSchedule(opt2, total_steps=10, cfg=cfg)
    sched2.load_state_dict(state)
    assert sched2.lr == sched.lr and sched2.total_steps == 50


@pytest.mark.parametrize(("old_total", "new_total", "end"), [(28, 56, 49), (28, 19, 21), (28, 28, 28)])
def test_a_resize_lands_the_rest_of_the_schedule_on_the_new_run(old_total, new_total, end):
    """Resumed at step 7 of a run of ``old_total`` steps, a quarter of its samples trained, on a
    world size whose uninterrupted run takes ``new_total`` steps and whose resumed run ends at
    ``end``: the lr continues at the new run's curve where it has trained a quarter of its
    samples, and the last step is the new curve's last."""
    cfg = load_config(None, ["training.warmup_steps=2"]).training
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    sched = LRSchedule(opt, total_steps=old_total, cfg=cfg)
    for _ in range(7):
        sched.step()
    state = rescaled(step=7, progress=0.25, total_steps=new_total, end_step=end)
    resumed = LRSchedule(build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg), total_steps=new_total,
                         cfg=cfg, state=state)
    assert resumed.lr == pytest.approx(lr_at(new_total / 4, total_steps=new_total, cfg=cfg))
    assert resumed.end_step == end
    lrs = []
    while resumed.step_count < end:
        lrs.append(resumed.lr)
        resumed.step()
    assert all(lr > 0 for lr in lrs) and all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] == pytest.approx(lr_at(new_total - 1, total_steps=new_total, cfg=cfg),
                                    rel=0.1 if new_total != end else 1e-12)
    assert resumed.lr == 0  # min_lr, after the last step
    again = LRSchedule(build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg), total_steps=1, cfg=cfg,
                       state=resumed.state_dict())
    assert again.lr == resumed.lr and again.end_step == end


def test_nonfinite_step_is_skipped_on_device():
    cfg = load_config().training
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([p], cfg)
    p.grad = torch.full((3,), float("nan"))
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
    assert float(opt.state[p]["step"]) == 0.0
    p.grad = torch.ones(3)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))
