"""BatchPrefetcher: plan order, round-robin consumers, exactly-once, resume, errors, metrics."""

import threading
import time

import numpy as np
import pytest
import torch

from dflash_trainer.config import PipelineConfig
from dflash_trainer.data.buckets import build_plan
from dflash_trainer.model.batch import Batch
from dflash_trainer.training.pipeline.channel import Channel
from dflash_trainer.training.pipeline.metrics import combine
from dflash_trainer.training.pipeline.prefetch import BatchPrefetcher, PrefetchOptions
from dflash_trainer.training.pipeline.stage import Supervisor

BLOCK = 4
ANCHORS = 6


class ArrayDataset:
    """In-memory token store: ids start at 1 (0 is padding); the first third is the prompt."""

    def __init__(self, lengths: np.ndarray, seed: int = 0, fail_at: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.tokens = [rng.integers(1, 1000, n).astype(np.int32) for n in self.lengths]
        self.masks = [(np.arange(n) >= n // 3).astype(np.uint8) for n in self.lengths]
        self.fail_at = fail_at
        self.touched: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.touched.append(i)
        if i == self.fail_at:
            raise OSError(f"corrupt record {i}")
        return self.tokens[i], self.masks[i]


LENGTHS = np.random.default_rng(7).integers(8, 200, 160)
CFG = PipelineConfig(num_buckets=4, tokens_per_batch=400, max_run=2)


def plan_for(world_size: int = 1, lengths: np.ndarray = LENGTHS):
    return lambda epoch: build_plan(lengths, CFG, seed=11, epoch=epoch, world_size=world_size)


def make(dataset, plans, *, consumers: int = 1, workers: int = 2, rank: int = 0, capacity: int = 2,
         stop: threading.Event | None = None, epochs: int = 1, **options):
    stop = stop or threading.Event()
    channels = [Channel(f"batches{c}", capacity, stop) for c in range(consumers)]
    pre = BatchPrefetcher(dataset, plans, PrefetchOptions(rank=rank, num_workers=workers,
                                                          num_anchors=ANCHORS, block_size=BLOCK,
                                                          seed=5, epochs=epochs, **options),
                          outputs=channels, stop=stop)
    return pre, channels


def drain(channels: list[Channel]) -> list[list[Batch]]:
    """Read every channel on its own thread until end-of-stream."""
    got: list[list[Batch]] = [[] for _ in channels]

    def read(c: int) -> None:
        got[c].extend(channels[c])

    threads = [threading.Thread(target=read, args=(c,)) for c in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive()
    return got


def expected(plan_fn, epochs, rank: int = 0, start=(0, 0)):
    out = []
    for epoch in range(start[0], epochs):
        plan = plan_fn(epoch)
        first = start[1] if epoch == start[0] else 0
        out += [(epoch, s, plan.steps[s].batches[rank].tolist()) for s in range(first, len(plan))]
    return out


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_plan_order_and_round_robin_consumers(workers, consumers):
    plan_fn = plan_for()
    pre, channels = make(ArrayDataset(LENGTHS), plan_fn, consumers=consumers, workers=workers,
                         epochs=2)
    pre.start()
    got = drain(channels)
    assert pre.close()
    counts = [len(g) for g in got]
    assert max(counts) - min(counts) <= 1
    for c, batches in enumerate(got):
        assert [b.stream_index for b in batches] == list(range(c, sum(counts), consumers))
    merged = sorted((b for g in got for b in g), key=lambda b: b.stream_index)
    assert [(b.epoch, b.step, b.sample_ids.tolist()) for b in merged] == expected(plan_fn, 2)


def test_every_sample_once_per_epoch_across_ranks():
    world = 2
    plan_fn = plan_for(world)
    per_epoch: dict[int, list[int]] = {0: [], 1: []}
    for rank in range(world):
        pre, channels = make(ArrayDataset(LENGTHS), plan_fn, rank=rank, epochs=2)
        pre.start()
        for batch in drain(channels)[0]:
            per_epoch[batch.epoch] += batch.sample_ids.tolist()
        pre.close()
    for epoch, ids in per_epoch.items():
        dropped = plan_fn(epoch).dropped.tolist()
        assert sorted(ids + dropped) == list(range(len(LENGTHS)))


def test_collated_batch_matches_the_dataset_and_pads_with_masks_off():
    dataset = ArrayDataset(LENGTHS)
    pre, channels = make(dataset, plan_for())
    pre.start()
    batches = drain(channels)[0]
    pre.close()
    for batch in batches:
        rows, width = batch.shape
        assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.bool
        assert width == int(batch.seq_lens.max())
        for r, i in enumerate(batch.sample_ids):
            n = int(dataset.lengths[i])
            assert batch.seq_lens[r] == n
            assert torch.equal(batch.input_ids[r, :n], torch.from_numpy(dataset.tokens[i]).long())
            assert not batch.input_ids[r, n:].any() and not batch.loss_mask[r, n:].any()
            assert batch.attention_mask[r, :n].all() and not batch.attention_mask[r, n:].any()
        assert batch.num_tokens == int(batch.seq_lens.sum())
        assert batch.anchors.shape[0] == rows and 1 <= batch.anchors.shape[1] <= ANCHORS
        assert batch.keep.dtype == torch.bool and batch.keep.any(dim=1).all()
        picked = batch.loss_mask.gather(1, batch.anchors)
        assert picked[batch.keep].all()
        # Every anchor and its first label inside the row's real tokens.
        assert (batch.anchors + 1 < batch.seq_lens[:, None])[batch.keep].all()


def test_anchors_do_not_depend_on_worker_count():
    def run(workers):
        pre, channels = make(ArrayDataset(LENGTHS), plan_for(), workers=workers)
        pre.start()
        batches = drain(channels)[0]
        pre.close()
        return batches

    one, four = run(1), run(4)
    assert len(one) == len(four)
    for a, b in zip(one, four):
        assert torch.equal(a.anchors, b.anchors) and torch.equal(a.keep, b.keep)


def test_resume_from_acknowledged_position_reproduces_in_flight_batches():
    plan_fn = plan_for()
    epochs = 2
    stop = threading.Event()
    pre, channels = make(ArrayDataset(LENGTHS), plan_fn, epochs=epochs, capacity=3, stop=stop)
    first_steps = len(plan_fn(0))
    trained: list[Batch] = []
    with Supervisor(stop) as sup:
        sup.add(pre)
        sup.start()
        for batch in sup.iterate(channels[0]):
            trained.append(batch)
            pre.acknowledge(batch)
            if len(trained) == first_steps + 2:  # into the second epoch
                break
        # Batches still queued or being built when the checkpoint is taken.
        time.sleep(0.2)
        state = pre.state_dict()
    assert (state["epoch"], state["step"], state["stream_index"]) == (1, 2, first_steps + 2)

    resumed, channels2 = make(ArrayDataset(LENGTHS), plan_fn, epochs=epochs)
    resumed.load_state_dict(state)
    resumed.start()
    rest = drain(channels2)[0]
    resumed.close()
    keys = [(b.epoch, b.step, b.sample_ids.tolist()) for b in trained + rest]
    assert keys == expected(plan_fn, epochs)
    # The resumed batches are the ones the uninterrupted run would have produced.
    full, channels3 = make(ArrayDataset(LENGTHS), plan_fn, epochs=epochs)
    full.start()
    reference = drain(channels3)[0]
    full.close()
    for a, b in zip(rest, reference[len(trained):]):
        assert torch.equal(a.anchors, b.anchors) and a.stream_index == b.stream_index


def test_out_of_order_acknowledgements_advance_only_the_contiguous_prefix():
    plan_fn = plan_for()
    pre, channels = make(ArrayDataset(LENGTHS), plan_fn, consumers=2, epochs=1)
    pre.start()
    a, b = drain(channels)
    pre.close()
    pre.acknowledge(b[0])  # stream index 1 before 0
    assert pre.state_dict()["stream_index"] == 0
    pre.acknowledge(a[0])
    assert pre.state_dict()["stream_index"] == 2 and pre.state_dict()["step"] == 2
    with pytest.raises(ValueError, match="already acknowledged"):
        pre.acknowledge(a[0])


def test_state_refuses_another_seed_or_world_size():
    pre, _ = make(ArrayDataset(LENGTHS), plan_for(), epochs=1)
    state = pre.state_dict() | {"seed": 99}
    with pytest.raises(ValueError, match="training.seed"):
        pre.load_state_dict(state)
    stop = threading.Event()
    other, channels = make(ArrayDataset(LENGTHS), plan_for(world_size=2), epochs=1, stop=stop)
    other.load_state_dict(pre.state_dict() | {"world_size": 1})
    with pytest.raises(ValueError, match="same world size"), Supervisor(stop) as sup:
        sup.add(other)
        sup.start()
        list(sup.iterate(channels[0]))


def test_worker_error_propagates_with_every_thread_joined():
    plan = plan_for()(0)
    bad = int(plan.steps[5].batches[0][0])
    stop = threading.Event()
    pre, channels = make(ArrayDataset(LENGTHS, fail_at=bad), plan_for(), workers=3, stop=stop)
    start = time.monotonic()
    with pytest.raises(OSError, match=f"corrupt record {bad}") as info:
        with Supervisor(stop) as sup:
            sup.add(pre)
            sup.start()
            for _ in sup.iterate(channels[0]):
                pass
    assert time.monotonic() - start < 10
    assert any("stage 'prefetch'" in note for note in info.value.__notes__)
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetch")]


def test_workers_cannot_run_unboundedly_ahead_of_a_slow_consumer():
    plan = plan_for()(0)
    dataset = ArrayDataset(LENGTHS)
    pre, channels = make(dataset, plan_for(), workers=4, capacity=2, reorder_window=3)
    pre.start()
    time.sleep(0.5)  # nobody consumes
    step_of = {int(i): s for s, step in enumerate(plan.steps) for i in step.batches[0]}
    furthest = max(step_of[i] for i in dataset.touched)
    # Steps 0-1 sit in the channel (capacity 2); the window allows 3 more claims past the
    # dispatched ones: steps 2 (blocked in put), 3 and 4.
    assert furthest <= 4
    assert len(drain(channels)[0]) == len(plan)
    pre.close()


def test_metrics_count_dispatched_and_trained_batches():
    plan = plan_for()(0)
    pre, channels = make(ArrayDataset(LENGTHS), plan_for())
    pre.start()
    batches = drain(channels)[0]
    pre.close()
    buckets = range(plan.num_buckets)
    steps_per_bucket = [float(c) for c in plan.stats.steps_per_bucket]
    unacknowledged = combine([pre.get_metrics()])
    assert [unacknowledged[f"data/bucket/{b}/dispatched"] for b in buckets] == steps_per_bucket
    assert sum(unacknowledged[f"data/bucket/{b}/trained"] for b in buckets) == 0
    assert unacknowledged["pipe/queue/batches0/puts"] == len(plan)
    for batch in batches:
        pre.acknowledge(batch)
    m = combine([pre.get_metrics()])
    assert [m[f"data/bucket/{b}/trained"] for b in buckets] == steps_per_bucket
    assert sum(m[f"data/bucket/{b}/dispatched"] for b in buckets) == 0
    assert m["data/padding_efficiency"] == pytest.approx(plan.stats.padding_efficiency)
    assert m["data/max_same_bucket_run"] == plan.stats.max_run
    assert m["data/seq_len_min"] <= m["data/seq_len_mean"] <= m["data/seq_len_max"]
    assert 0.0 <= m["pipe/prefetch/busy_frac"] <= 1.0
    again = combine([pre.get_metrics()])
    assert sum(again[f"data/bucket/{b}/trained"] for b in buckets) == 0
    assert "data/padding_efficiency" not in again
    assert again["pipe/queue/batches0/puts"] == 0


def test_pin_memory_without_cuda_warns():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is real there")
    with pytest.warns(UserWarning, match="pin_memory has no effect"):
        make(ArrayDataset(LENGTHS), plan_for(), pin_memory=True)


def test_pinning_workers_make_the_ranks_gpu_their_current_device(monkeypatch):
    """A new thread starts on GPU 0: pinning there would give every rank a context on it."""
    current: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: current.__setitem__(threading.current_thread().name, d))
    monkeypatch.setattr(Batch, "pin_memory", lambda self: self)  # no CUDA build here
    device = torch.device("cuda", 1)
    pre, channels = make(ArrayDataset(LENGTHS), plan_for(), workers=2, pin_memory=True,
                         device=device)
    with Supervisor(pre.stop) as sup:
        sup.add(pre)
        sup.start()
        batches = drain(channels)[0]
    assert len(batches) == len(plan_for()(0))
    assert current == {"prefetch/worker0": device, "prefetch/worker1": device}


def test_a_plan_builder_that_returns_another_epoch_is_refused():
    stop = threading.Event()
    pre, channels = make(ArrayDataset(LENGTHS), lambda epoch: plan_for()(0), epochs=2, stop=stop)
    with pytest.raises(ValueError, match="returned epoch 0 for epoch 1"), Supervisor(stop) as sup:
        sup.add(pre)
        sup.start()
        list(sup.iterate(channels[0]))
