"""Drafter variants as plug-ins (model/variants): the common path names no variant, the registry
agrees with the config schema, and DFlash and DFlash2 train and export as they did before the
variants moved behind the interface (tests/data/variant_golden.json, tests/helpers_variants.py),
within float32 tolerances that hold on any CPU."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import torch
from helpers_variants import CASES, DEMO, GOLDEN, MASK, batches, differences, record, tiny_target

import dflash_trainer
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.loss import MetricSpec
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.variants import VARIANTS, LossTerms, SlotInputs, TermSums, get_variant, variant_of
from dflash_trainer.training.optim import LRSchedule, build_optimizer
from dflash_trainer.training.pipeline.drafter_step import DrafterStep
from dflash_trainer.training.pipeline.metrics import combine

PACKAGE = Path(dflash_trainer.__file__).parent
VARIANT_NAMES = re.compile(r"dflash2|selector|dspark", re.IGNORECASE)
"""What names a variant other than the plain DFlash backbone (DSpark: issue 43): its name, or its
modules'. A module outside the variant's own that says one of them knows that variant."""

CONFIG_ALLOWED = ("ModelConfig", "TrainingConfig", "validate")
"""In config.py, a variant's options are declared (``model.*``, ``training.*``, each with its
documentation) and checked against ``model.variant`` at load time (``validate``): the schema sits
below the model part, so it cannot ask the registry. Only there may config.py name a variant."""


def _owned(relative: str) -> bool:
    """The registry, and each variant's own module and standalone modeling file."""
    return relative == "model/variants/__init__.py" or any(
        relative in (f"model/variants/{name}.py", f"model/modeling/{name}.py") for name in VARIANTS)


def _allowed_lines(source: str) -> set[int]:
    """The lines of config.py's :data:`CONFIG_ALLOWED` definitions, their decorators included
    (a section's resume rules name its options)."""
    lines: set[int] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in CONFIG_ALLOWED:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines |= set(range(first, (node.end_lineno or node.lineno) + 1))
    return lines


def variant_mentions(package: Path = PACKAGE) -> list[str]:
    """``path:line: text`` of every mention of a variant outside its own modules and the registry."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if _owned(path.relative_to(package).as_posix()):
            continue
        source = path.read_text(encoding="utf-8")
        allowed = _allowed_lines(source) if path == package / "config.py" else set()
        for number, line in enumerate(source.splitlines(), start=1):
            if number not in allowed and VARIANT_NAMES.search(line):
                found.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    return found


def test_the_common_path_names_no_variant() -> None:
    mentions = variant_mentions()
    assert not mentions, ("a variant is named outside its own module (model/variants/NAME.py, "
                          "model/modeling/NAME.py) and the registry:\n" + "\n".join(mentions))


def test_the_scan_finds_a_variant_named_in_the_common_path(tmp_path: Path) -> None:
    (tmp_path / "model" / "variants").mkdir(parents=True)
    (tmp_path / "config.py").write_text('class ModelConfig:\n    variant = "dflash2"\n\n\nX = "DSpark"\n')
    (tmp_path / "model" / "objective.py").write_text('selector = getattr(drafter, "candidate_selector")\n')
    (tmp_path / "model" / "variants" / "dflash2.py").write_text('NAME = "dflash2"\n')
    (tmp_path / "model" / "variants" / "base.py").write_text('"""DFlash2 in an example."""\n')
    found = variant_mentions(tmp_path)
    assert found == ['config.py:5: X = "DSpark"',
                     'model/objective.py:1: selector = getattr(drafter, "candidate_selector")',
                     'model/variants/base.py:1: """DFlash2 in an example."""']


def test_the_registry_and_the_config_schema_list_the_same_variants() -> None:
    hints = typing.get_type_hints(ModelConfig)
    assert list(typing.get_args(hints["variant"])) == list(VARIANTS)
    assert get_variant("dflash").name == "dflash"
    with pytest.raises(ConfigError, match=r"^model.variant: got 'nope', accepted values: 'dflash', 'dflash2', "
                                          r"'dspark'$"):
        get_variant("nope")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_declares_a_loadable_class_and_its_files(name: str) -> None:
    variant = VARIANTS[name]
    assert variant.model_class.__name__ == variant.architecture
    assert all(path.is_file() for path in variant.modeling_paths())
    assert name in variant.warm_starts_from
    config = variant.model_class.config_class(architectures=[variant.architecture])
    assert variant_of(config) is variant


@pytest.mark.parametrize("case", list(CASES))
def test_training_and_export_are_as_before_the_move(case: str) -> None:
    """A golden recorded on one CPU, checked on any: each step's logged training metrics (loss,
    grad norm, accuracies, the variant's own) and the exported tensors' fingerprints, on the shrunk
    demo config, within the stated tolerances of helpers_variants.TOLERANCES (float32 sums in
    another order on another instruction set); config.json exactly."""
    golden = json.loads(GOLDEN.read_text())[case]
    got = record(case)
    assert not differences(got, golden), "\n".join(differences(got, golden))
    # Key order included: the export writes the same file.
    assert json.dumps(got["config"]) == json.dumps(golden["config"])


def test_the_golden_check_sees_a_change_beyond_its_tolerances() -> None:
    """The tolerances are narrow enough to fail: a loss 0.1% off, a flipped accuracy of two
    blocks, one exported tensor scaled by 1.01, or a step's token count off by one."""
    golden = json.loads(GOLDEN.read_text())["dflash-demo"]
    assert differences(golden, golden) == []

    def changed(path: tuple, scale: float = 1.0, add: float = 0.0) -> dict:
        copy = json.loads(json.dumps(golden))
        *parents, key = path
        node = copy
        for part in parents:
            node = node[part]
        node[key] = (float.fromhex(node[key]) * scale + add).hex()
        return copy

    name = sorted(golden["weights"])[0]
    assert differences(changed(("steps", 2, "train/loss"), scale=1.001), golden) == [
        f"step 3: train/loss {float.fromhex(golden['steps'][2]['train/loss']) * 1.001!r} != "
        f"{float.fromhex(golden['steps'][2]['train/loss'])!r}"]
    assert differences(changed(("steps", 0, "train/acc"), add=2 / 12), golden)
    assert differences(changed(("steps", 0, "train/tokens"), add=1), golden)
    assert differences(changed(("weights", name, "projection"), scale=1.01, add=1e-2), golden)
    assert differences(changed(("weights", name, "norm"), scale=1.01), golden)


class _NormTerms(LossTerms):
    """A stand-in for a new variant's terms: a loss on the slot states' squared norm, and a
    per-slot count, each logged by the name it declares."""

    top_k = 2
    weights = {"norm_loss": 0.25}
    metrics = (MetricSpec("train/norm_loss", "norm_loss", "weight"),
               MetricSpec("train/top2_pos/{k}", "top2_per_slot", "count_per_slot"))

    def __call__(self, inputs: SlotInputs) -> TermSums:
        assert inputs.candidates is not None and inputs.candidates[1].shape[-1] == 2
        norms = inputs.hidden.float().pow(2).sum(-1)
        in_top2 = (inputs.candidates[1] == inputs.labels[..., None]).any(-1) & (inputs.weights > 0)
        return TermSums(losses={"norm_loss": (inputs.weights * norms).sum()},
                        counts={"top2_per_slot": in_top2.sum(dim=(0, 1))})


def test_a_variant_s_terms_reach_the_objective_and_its_metrics_the_step_by_name() -> None:
    """What a new variant plugs in (its loss terms, their weights, its count sums and metrics)
    goes through the objective and the drafter step with no change to either."""
    cfg = load_config(DEMO, ["model.target_layer_ids=[1,2]", "model.dtype=float32", "training.loss_slots=null",
                             "training.num_anchors=6", "training.labels=data", "model.drafter_init=random"])
    target = tiny_target()
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target.config, mask_token_id=MASK)
    objective = DFlashObjective(drafter, target.model.embed_tokens.weight, target.lm_head.weight, gamma=None,
                                loss_chunk_size=16, terms=_NormTerms())
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.training)
    step = DrafterStep(objective=objective, parameters=params, optimizer=optimizer,
                       schedule=LRSchedule(optimizer, total_steps=2, cfg=cfg.training), cfg=cfg.training,
                       dist_info=DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                       block_size=drafter.block_size, autocast_dtype=None)
    item = batches(target, drafter.target_layer_ids, "data", 6)[0]
    sums = objective(item.batch, item.target, 0)
    torch.testing.assert_close(sums.objective(), sums.loss + 0.25 * sums.terms["norm_loss"])
    step.train_micro_batch(item)
    metrics = combine([step.get_metrics()])
    assert metrics["train/norm_loss"] == pytest.approx(float(sums.terms["norm_loss"].detach() / sums.weight))
    counts = sums.counts["top2_per_slot"].tolist()
    assert [metrics[f"train/top2_pos/{k}"] for k in (1, 2, 3)] == pytest.approx(
        [c / n for c, n in zip(counts, sums.count_per_slot.tolist())])
    assert metrics["train/acc_pos/3"] >= 0 and "train/loss" in metrics
    with pytest.raises(ValueError, match=r"reuse a name of another sum: \['count'\]"):
        dataclasses.replace(sums, counts={"count": sums.count})
