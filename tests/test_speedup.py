"""Speedups measured side by side: real decoders on a tiny target, timed by an injected clock
that charges every target forward a cost, so that load on one arm can be simulated exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_evaluate import tiny_target
from transformers import LlamaForCausalLM

from dflash_trainer.config import ModelConfig
from dflash_trainer.evaluation.evaluate import InTrainingEval, request_result, summarize
from dflash_trainer.evaluation.prompt_sets import EvalPrompt
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.evaluation.spec_decode import Decoded, speculative_generate, target_generate
from dflash_trainer.evaluation.speedup import (SCATTER_BOUND, LoadSample, MachineProbe, PairedTimer, PairedTiming,
                                               SpeedupMeasurement, describe_measurement, format_speedup,
                                               free_core_threads)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
MAX_NEW = 16
QUIET = MachineProbe(cpus=lambda: 2, load_average=lambda: 0.0, others_running=lambda: 0.0)


class ForwardClock:
    """Simulated seconds: every target forward advances the clock by ``cost(arm, pair)``.

    ``arm`` is the decoder whose prefill came last (``"target"`` or ``"spec"``: only the
    speculative prefill asks for hidden states) and ``pair`` the index of the target-only
    decode in its run (target prefills seen, minus one)."""

    def __init__(self, cost: Callable[[str, int], float] = lambda arm, pair: 1.0) -> None:
        self.cost = cost
        self.now = 0.0
        self.arm = "target"
        self.target_prefills = 0
        self.prefills: list[str] = []

    def __call__(self) -> float:
        return self.now

    def _tick(self, _module, _args, kwargs) -> None:
        if kwargs.get("logits_to_keep") == 1:  # a prefill
            self.arm = "spec" if kwargs.get("output_hidden_states") else "target"
            self.target_prefills += self.arm == "target"
            self.prefills.append(self.arm)
        self.now += self.cost(self.arm, max(self.target_prefills - 1, 0))

    @contextlib.contextmanager
    def attached(self, target: torch.nn.Module) -> Iterator[ForwardClock]:
        handle = target.register_forward_pre_hook(self._tick, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return build_drafter(ModelConfig(num_layers=1, block_size=BLOCK), target.config, mask_token_id=127)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 120, (6 + k,), generator=generator).tolist() for k in range(4)]


def evaluator(target, prompts, clock: ForwardClock, probe: MachineProbe = QUIET) -> InTrainingEval:
    return InTrainingEval(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                          timer=PairedTimer(clock=clock, probe=probe, threads=1))


def steps_rate(requests) -> float:
    """The speedup when a target forward costs the same in both arms: tokens per verify step."""
    return sum(r.spec_decode_tokens for r in requests) / sum(r.steps for r in requests)


def test_same_conditions_give_a_reliable_speedup_and_alternate_the_order(target, drafter, prompts):
    clock = ForwardClock()
    evaluate = evaluator(target, prompts, clock)
    with clock.attached(target):
        metrics = evaluate(drafter)
    requests, measured = evaluate.last_requests, evaluate.last_speedup
    # Pair k runs the target first for even k, the speculative decode first for odd k.
    assert [r.timing.target_first for r in requests] == [True, False, True, False]
    assert clock.prefills == ["target", "spec", "spec", "target", "target", "spec", "spec", "target"]
    assert measured.reliable is True and measured.reasons == [] and measured.step_cost_scatter == 1.0
    assert metrics["eval/speedup"] == pytest.approx(steps_rate(requests)) and metrics["eval/speedup_reliable"] == 1
    # The ratio of sums: (sum T / sum n) / (sum S / sum m) over the prompts.
    ratio = ((sum(r.target_decode_s for r in requests) / sum(r.target_decode_tokens for r in requests))
             / (sum(r.spec_decode_s for r in requests) / sum(r.spec_decode_tokens for r in requests)))
    assert measured.speedup == pytest.approx(ratio)


def test_a_baseline_slowed_on_the_first_prompts_is_flagged_as_scatter(target, drafter, prompts):
    """Load that hit only the target-only arm of the first two prompts (as a baseline timed at
    a busy moment would) inflates those prompts' speedups 5x: the figure is marked unreliable."""
    clock = ForwardClock(cost=lambda arm, pair: 5.0 if arm == "target" and pair < 2 else 1.0)
    evaluate = evaluator(target, prompts, clock)
    with clock.attached(target):
        metrics = evaluate(drafter)
    measured = evaluate.last_speedup
    assert measured.step_cost_scatter == pytest.approx(5.0) and measured.step_cost_scatter > SCATTER_BOUND
    assert measured.reliable is False and metrics["eval/speedup_reliable"] == 0
    assert len(measured.reasons) == 1 and measured.reasons[0].startswith("scatter: per-prompt step cost varies 5.00x")
    assert "(unreliable: scatter" in measured.label()
    fields = summarize(evaluate.last_requests, block_size=BLOCK, temperature=0.0, speedup=measured)
    assert fields["speedup_reliable"] is False and fields["speedup_unreliable_reasons"] == measured.reasons


@pytest.mark.slow
def test_a_baseline_from_another_moment_is_never_divided_into_a_speedup(target, drafter, prompts):
    """The evaluator is built while the machine is 20x slower; its calls at normal speed give
    the same speedup as an evaluator built at normal speed: every call times its own baseline."""
    clock = ForwardClock(cost=lambda arm, pair: 20.0)
    with clock.attached(target):
        evaluate = evaluator(target, prompts, clock)
    clock.cost = lambda arm, pair: 1.0
    with clock.attached(target):
        first = evaluate(drafter)
    assert first["eval/speedup"] == pytest.approx(steps_rate(evaluate.last_requests))
    # Later the whole machine slows down 7x: both arms of every pair slow alike.
    clock.cost = lambda arm, pair: 7.0
    with clock.attached(target):
        later = evaluate(drafter)
    assert later["eval/speedup"] == pytest.approx(first["eval/speedup"]) and later["eval/speedup_reliable"] == 1
    # Decodes that were not timed side by side give no speedup at all.
    baseline = target_generate(target, torch.tensor([prompts[0]]), max_new_tokens=MAX_NEW, stop_token_ids=[])
    spec = speculative_generate(drafter, target, torch.tensor([prompts[0]]), max_new_tokens=MAX_NEW,
                                stop_token_ids=[])
    unpaired = request_result(EvalPrompt(id="p", turns=[""]), 0, len(prompts[0]), baseline, spec, temperature=0.0)
    assert unpaired.speedup is None and unpaired.to_json()["speedup"] is None
    summary = summarize([unpaired], block_size=BLOCK, temperature=0.0)
    assert summary["speedup"] is None and summary["speedup_reliable"] is None


def test_threads_come_from_the_free_cores_and_are_restored():
    seen = []

    def arm(steps: int) -> Callable[[Callable[[], float]], Decoded]:
        def decode(clock):
            seen.append(torch.get_num_threads())
            return Decoded(tokens=[1] * 9, prefill_s=0.0, decode_s=float(steps),
                           acceptance_lengths=[1] * steps if steps < 8 else [])
        return decode

    busy = MachineProbe(cpus=lambda: 2, load_average=lambda: 2.0, others_running=lambda: 1.0)
    with PairedTimer(probe=busy).run() as run:
        run.pair(arm(8), arm(4))
    assert seen == [1, 1] and torch.get_num_threads() == 1  # the module fixture's count, restored
    assert run.measurement.threads == 1 and run.measurement.reliable is True  # one busy core, one left: fine
    with PairedTimer(probe=busy, threads=2).run() as run:
        run.pair(arm(8), arm(4))
    assert seen[2:] == [2, 2] and torch.get_num_threads() == 1
    assert run.measurement.reliable is False and run.measurement.reasons[0].startswith("busy: load 1.0")


@given(cpus=st.integers(1, 256), others=st.floats(0, 512))
def test_free_core_threads_bounds(cpus, others):
    threads = free_core_threads(cpus, others)
    assert 1 <= threads <= cpus
    assert threads == 1 or threads + others <= cpus + 0.5  # never more threads than free cores
    assert free_core_threads(cpus, None) == cpus


def measurement(*, threads: int, others: float, load_after: float, cpus: int = 2) -> SpeedupMeasurement:
    timing = PairedTiming(index=0, target_first=True, threads=threads, target_s=2.0, target_tokens=8,
                          spec_s=1.0, spec_tokens=8, spec_steps=8)
    return SpeedupMeasurement.from_pairs([timing], threads=threads, cpus=cpus,
                                         before=LoadSample(load_1m=None, others_running=others),
                                         after=LoadSample(load_1m=load_after, others_running=0.0))


def test_busy_rule_counts_only_load_beyond_the_evaluation_and_free_cores():
    assert measurement(threads=2, others=0.0, load_after=2.4).reliable  # its own two threads
    assert measurement(threads=1, others=1.0, load_after=2.0).reliable  # a neighbour on the other core
    busy = measurement(threads=2, others=0.0, load_after=3.2)
    assert not busy.reliable and busy.reasons == ["busy: load 1.2 from other work beside 2 eval threads on 2 cores"]
    assert not measurement(threads=1, others=1.6, load_after=1.0).reliable
    assert busy.speedup == 2.0 and busy.step_cost_scatter is None  # one prompt: nothing to scatter


def test_labels():
    assert format_speedup(0.784, True) == "0.78"
    assert format_speedup(0.784, False, ["busy: load 2.3"]) == "0.78 (unreliable: busy: load 2.3)"
    assert format_speedup(6.47, None) == "6.47 (reliability not recorded)"
    assert format_speedup(None, None) == format_speedup(float("nan"), True) == "n/a"
    fields = measurement(threads=2, others=0.0, load_after=2.4).summary_fields()
    assert set(fields) == {"speedup", "speedup_reliable", "speedup_unreliable_reasons", "speedup_measurement"}
    assert describe_measurement(fields["speedup_measurement"]).startswith(
        "1 prompts side by side in alternating order, 2 torch threads on 2 cores, 1-min load ? before and 2.40 after")


def test_the_break_even_tau_is_the_pooled_step_cost():
    from dflash_trainer.evaluation.speedup import pay_off_line

    timings = [PairedTiming(index=i, target_first=i % 2 == 0, threads=1, target_s=t, target_tokens=40, spec_s=s,
                            spec_tokens=40, spec_steps=steps) for i, (t, s, steps) in
               enumerate([(4.0, 5.0, 30), (2.0, 2.0, 16)])]
    sample = LoadSample(load_1m=0.1, others_running=0.0)
    m = SpeedupMeasurement.from_pairs(timings, threads=1, cpus=2, before=sample, after=sample)
    tau = 80 / 46
    # speedup = tau / step_cost, pooled over both pairs
    assert m.step_cost == pytest.approx((7.0 / 46) / (6.0 / 80))
    assert m.speedup == pytest.approx(tau / m.step_cost)
    assert m.summary_fields()["speedup_measurement"]["step_cost"] == m.step_cost
    assert pay_off_line(m.speedup, m.step_cost, tau).startswith("the drafter does not pay on this machine")
    assert pay_off_line(1.4, 1.1, 1.54).startswith("the drafter pays on this machine (1.40x)")
    assert pay_off_line(None, 1.1, 1.5) is None and pay_off_line(0.8, float("nan"), 1.5) is None
