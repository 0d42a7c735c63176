"""TargetStage: batches in, the target's outputs for them out, in order, then end-of-stream."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.target import FeatureExtractor
from dflash_trainer.pipeline.channel import Channel
from dflash_trainer.pipeline.metrics import Sum
from dflash_trainer.pipeline.stage import Supervisor
from dflash_trainer.pipeline.target_stage import TargetStage

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
        assert item.ready is None and len(item.tensors()) == (2 if labels == "kl" else 1)
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
