"""TargetStage: batches in, the target's outputs for them out, in order, then end-of-stream;
every tensor that crosses the stage's stream is listed; the stage thread's device; the stop
agreement of a sharded target."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.target import FeatureExtractor, TargetOutputs
from dflash_trainer.training.pipeline import target_stage
from dflash_trainer.training.pipeline.channel import Channel
from dflash_trainer.training.pipeline.metrics import Sum
from dflash_trainer.training.pipeline.stage import Supervisor
from dflash_trainer.training.pipeline.target_stage import PeerStopped, TargetStage

CPU = torch.device("cpu")


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def batch(step: int, rows: int, width: int) -> Batch:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 256, (rows, width), generator=gen)
    seq_lens = torch.full((rows,), width)
    seq_lens[-1] = width // 2
    ids[-1, width // 2:] = 0
    anchors = torch.zeros(rows, 1, dtype=torch.long)
    b = Batch.of_rows(ids, ids > 0, anchors=anchors, keep=anchors == 0, seq_lens=seq_lens)
    return Batch(**{**b.__dict__, "step": step, "stream_index": step})


@pytest.mark.parametrize("labels", ["data", "kl"])
def test_outputs_match_the_extractor_in_order_and_count_tokens(labels):
    target = tiny_target()
    extractor = FeatureExtractor(target, [1, 2], labels=labels)
    stop = threading.Event()
    inputs, outputs = Channel("batches", 2, stop), Channel("features", 1, stop)
    stage = TargetStage(extract=extractor, inputs=inputs, output=outputs, device=CPU, stop=stop)
    sent = [batch(step, rows=2 + step % 2, width=12 + step) for step in range(4)]
    with Supervisor(stop) as sup:
        sup.add(stage)
        sup.start()

        def feed() -> None:
            for b in sent:
                inputs.put(b)
            inputs.finish()

        feeder = threading.Thread(target=feed)
        feeder.start()
        got: list[StepInput] = list(sup.iterate(outputs))
        feeder.join(10)
    assert [item.batch.step for item in got] == [0, 1, 2, 3]
    for item, b in zip(got, sent, strict=True):
        want = extractor(b.input_ids, b.attention_mask)
        assert torch.equal(item.target.features, want.features)
        assert item.target.features.shape == (*b.shape, 2 * 64)
        assert (item.target.final_hidden is not None) == (labels == "kl")
        assert item.ready is None
        assert len(item.tensors()) == len(Batch.TENSORS) + (2 if labels == "kl" else 1)
    metrics = stage.get_metrics()
    assert metrics["pipe/target/tokens"] == Sum(float(sum(int(b.seq_lens.sum()) for b in sent)))
    assert metrics["pipe/target/forward_s"] > 0
    assert 0 < metrics["pipe/target/busy_frac"] <= 1
    extractor.close()


def test_threads_set_the_stage_threads_count_and_leave_the_callers():
    """pipeline.target_threads: the forward runs with the stage's own torch thread count."""
    seen: list[int] = []
    target = tiny_target()
    extractor = FeatureExtractor(target, [1, 2])

    def extract(input_ids: torch.Tensor, attention_mask: torch.Tensor):
        seen.append(torch.get_num_threads())
        return extractor(input_ids, attention_mask)

    before = torch.get_num_threads()
    stage_threads = 3 if before != 3 else 2
    stop = threading.Event()
    inputs, outputs = Channel("batches", 2, stop), Channel("features", 1, stop)
    stage = TargetStage(extract=extract, inputs=inputs, output=outputs, device=CPU, stop=stop,
                        threads=stage_threads)
    with Supervisor(stop) as sup:
        sup.add(stage)
        sup.start()
        inputs.put(batch(0, rows=2, width=8))
        inputs.finish()
        got = list(sup.iterate(outputs))
    assert len(got) == 1 and seen == [stage_threads]
    assert torch.get_num_threads() == before
    extractor.close()


def test_step_input_lists_every_tensor_of_the_batch_and_the_target():
    """What crosses the target stage's CUDA stream: every tensor-valued field of Batch and of
    TargetOutputs, whatever its annotation says (a field missing here would be freed while the
    drafter step still reads it on another stream)."""
    b = batch(0, rows=2, width=8)
    out = TargetOutputs(features=torch.zeros(2, 8, 4), target_labels=torch.zeros(2, 8),
                        final_hidden=torch.zeros(2, 8, 2))
    item = StepInput(batch=b, target=out)
    values = [getattr(obj, f.name) for obj in (b, out) for f in dataclasses.fields(obj)]
    expected = {id(v) for v in values if isinstance(v, torch.Tensor)}
    assert len(expected) >= 9
    assert {id(t) for t in item.tensors()} == expected
    # The copy to the device moves the same list (numpy and Python bookkeeping stay).
    moved = b.to("cpu")
    assert [name for name in Batch.TENSORS] == [
        f.name for f in dataclasses.fields(Batch) if isinstance(getattr(moved, f.name), torch.Tensor)]
    assert isinstance(moved.sample_ids, np.ndarray)


def test_stage_thread_makes_its_device_current(monkeypatch):
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: calls.append(("Stream", d)) or "stream")
    device = torch.device("cuda", 3)
    assert target_stage.stage_stream(device) == "stream"
    assert calls == [("set_device", device), ("Stream", device)]
    assert target_stage.stage_stream(CPU) is None and len(calls) == 2


class ScriptedAgreement:
    """A StopAgreement whose peers answer from a script: ``peer_stops_at`` is the round (0 =
    before the first forward) at which another rank stops."""

    def __init__(self, peer_stops_at: int | None = None) -> None:
        self.peer_stops_at = peer_stops_at
        self.rounds: list[bool] = []

    def any_stops(self, stop: bool) -> bool:
        self.rounds.append(stop)
        return stop or len(self.rounds) - 1 == self.peer_stops_at


def _run_stage(agreement: ScriptedAgreement, sent: list[Batch], *, fail: bool = False):
    target = tiny_target()
    extractor = FeatureExtractor(target, [1])
    stop = threading.Event()
    inputs, outputs = Channel("batches", 8, stop), Channel("features", 8, stop)
    stage = TargetStage(extract=extractor, inputs=inputs, output=outputs, device=CPU, stop=stop,
                        agreement=agreement)
    for b in sent:
        inputs.put(b)
    if fail:
        from dflash_trainer.training.pipeline.channel import StageFailure

        inputs.fail(StageFailure.capture(RuntimeError("prefetch broke"), "prefetch"))
    else:
        inputs.finish()
    got: list[int] = []
    try:
        with Supervisor(stop) as sup:
            sup.add(stage)
            sup.start()
            for item in sup.iterate(outputs):
                got.append(item.batch.step)
    finally:
        extractor.close()
    return got


def test_agreement_before_every_forward_and_at_the_end():
    agreement = ScriptedAgreement()
    got = _run_stage(agreement, [batch(i, rows=1, width=6) for i in range(3)])
    assert got == [0, 1, 2]
    assert agreement.rounds == [False, False, False, True], "3 forwards, then the end agreed"


def test_a_peer_stop_ends_the_forwards_and_fails_a_consumer_that_reads_on():
    agreement = ScriptedAgreement(peer_stops_at=2)
    with pytest.raises(PeerStopped, match="another rank's pipeline stopped first"):
        _run_stage(agreement, [batch(i, rows=1, width=6) for i in range(4)])
    assert agreement.rounds == [False, False, False], "no forward after the peer's stop"


def test_an_upstream_failure_is_agreed_as_a_stop_before_it_is_raised():
    agreement = ScriptedAgreement()
    with pytest.raises(RuntimeError, match="prefetch broke"):
        _run_stage(agreement, [batch(0, rows=1, width=6)], fail=True)
    assert agreement.rounds == [False, True]
