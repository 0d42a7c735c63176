"""The ``README.md`` model card of an exported drafter: what it is, for which target, how it was
trained and measured, and how each engine serves it.

Everything on the card comes from files: the export's ``config.json`` (variant, block size,
layers, tapped target layers, the target recorded under ``dflash_trainer``), its weights
(parameter count) and, when the export comes from a run, the run's ``config.yaml`` (data,
schedule, evaluation settings) and ``metrics.jsonl`` (steps, samples, the last evaluation).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from safetensors import safe_open

from dflash_trainer.core.version import __version__
from dflash_trainer.core.fsutil import atomic_write_text
from dflash_trainer.core.units import format_count
from dflash_trainer.model.drafter import SIGNATURE_KEY
from dflash_trainer.model.variants import Variant, variant_of

__all__ = ["CARD_FILE", "RunFacts", "model_card", "run_facts", "write_model_card"]

CARD_FILE = "README.md"


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a run says about a drafter it exported."""

    config: dict[str, Any]
    """The run's resolved config (``config.yaml``)."""
    step: int | None
    """The optimizer step the export holds."""
    samples: int | None = None
    """Training samples in the run's data (one epoch's plan)."""
    tokens: int | None = None
    """Tokens trained on up to ``step``."""
    tau: float | None = None
    """The last evaluation's acceptance length up to ``step``, and where it was taken."""
    tau_step: int | None = None
    lossless: bool | None = None


def _metrics(path: Path) -> list[dict[str, Any]]:
    records = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash; the report counts them
        if isinstance(record, dict):
            records.append(record)
    return records


def run_facts(run_dir: Path, *, step: int | None, config: dict[str, Any] | None = None) -> RunFacts | None:
    """The facts of the run in ``run_dir`` up to ``step`` (None: to its end); ``config`` when
    given (a checkpoint's own), else the run's ``config.yaml``. None without a config."""
    if config is None:
        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return None
    if not isinstance(config, dict):
        return None
    records = [r for r in _metrics(run_dir / "metrics.jsonl")
               if isinstance(r.get("step"), int) and (step is None or r["step"] <= step)]

    def last(key: str) -> dict[str, Any] | None:
        found = [r for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return found[-1] if found else None

    samples, tokens, evaluation = last("plan/samples"), last("train/tokens_total"), last("eval/tau")
    return RunFacts(config=config, step=step if step is not None else (records[-1]["step"] if records else None),
                    samples=int(samples["plan/samples"]) if samples else None,
                    tokens=int(tokens["train/tokens_total"]) if tokens else None,
                    tau=float(evaluation["eval/tau"]) if evaluation else None,
                    tau_step=int(evaluation["step"]) if evaluation else None,
                    lossless=bool(evaluation["eval/lossless"]) if evaluation and "eval/lossless" in evaluation
                    else None)


def _target_lines(record: dict[str, Any]) -> tuple[str, list[str]]:
    target = record.get("target") or {}
    name = str(target.get("name") or "the target it was trained for")
    lines = [f"- target: `{name}`"]
    if target.get("revision"):
        lines.append(f"- target revision (Hugging Face commit): `{target['revision']}`")
    if target.get("weights_sha256"):
        lines.append(f"- target weights sha256: `{target['weights_sha256']}`")
    lines.append(f"- the target's vocabulary {record.get('vocab_size', '?')} tokens, hidden size "
                 f"{record.get('hidden_size', '?')}")
    return name, lines


def _training_lines(run: RunFacts) -> list[str]:
    data = run.config.get("data") or {}
    training = run.config.get("training") or {}
    model = run.config.get("model") or {}
    paths = ", ".join(f"`{Path(str(p)).name}`" for p in data.get("paths") or []) or "?"
    lines = [f"- data: {paths}; samples of at most {data.get('max_length', '?')} tokens"
             + (f", {run.samples:,} training samples" if run.samples is not None else "")
             + (f", the first {data['heldout_samples']} records held out" if data.get("heldout_samples") else "")]
    lines.append(f"- steps: {run.step if run.step is not None else '?'}"
                 + (f" ({run.tokens:,} tokens)" if run.tokens is not None else "")
                 + f"; lr {training.get('lr', '?')}, schedule {training.get('schedule', '?')}, labels "
                 f"`{training.get('labels', '?')}`, drafter init `{model.get('drafter_init', '?')}`")
    return lines


def _eval_lines(run: RunFacts, *, target: str) -> list[str]:
    if run.tau is None:
        return ["The run did not evaluate this drafter. Measure it with:", "",
                "```bash", f"dflash-trainer eval --drafter DRAFTER_FOLDER --target {target}", "```"]
    ev = run.config.get("eval") or {}
    prompts, count = ev.get("prompts", "mtbench"), ev.get("in_training_prompts", 8)
    lossless = {True: ", lossless", False: ", NOT lossless (see the run's report)", None: ""}[run.lossless]
    return [f"Acceptance length tau **{run.tau:.3f}** at step {run.tau_step}: greedy speculative decoding "
            f"against the target's own output on the first turns of the first {count} prompts of `{prompts}`, "
            f"{ev.get('max_new_tokens', '?')} new tokens each{lossless}. The same measurement:", "",
            "```bash",
            f"dflash-trainer eval --drafter DRAFTER_FOLDER --target {target} --prompts {prompts} "
            f"eval.num_prompts={count} eval.first_turn_only=true eval.max_new_tokens={ev.get('max_new_tokens', 256)}",
            "```"]


def _serving_lines(config: dict[str, Any], *, target: str) -> list[str]:
    variant = variant_of_config(config)
    block = int(config.get("block_size") or (config.get("dflash_config") or {}).get("block_size"))
    lines = ["`DRAFTER_FOLDER` is this folder, `TARGET` the target's Hugging Face id or folder "
             f"(`{target}`).", "",
             "vLLM (`num_speculative_tokens` is the block size minus one):", "", "```bash",
             f"vllm serve TARGET --speculative-config '{{\"method\": \"{variant.vllm_method}\", "
             f"\"model\": \"DRAFTER_FOLDER\", \"num_speculative_tokens\": {block - 1}}}' \\",
             "    --attention-backend flash_attn   # on GPUs: the draft needs a non-causal-capable backend",
             "```", ""]
    if variant.name == "dflash":
        lines += ["SGLang (`--speculative-num-draft-tokens` is the block size):", "", "```bash",
                  "python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\",
                  f"    --speculative-draft-model-path DRAFTER_FOLDER --speculative-num-draft-tokens {block}",
                  "```", ""]
    else:
        lines += [f"SGLang: its `DFLASH` algorithm loads DFlash drafters; a {variant.title} export is not "
                  "known to load there.", ""]
    lines += ["llama.cpp (the drafter converted with llama.cpp's own script, which reads the tokenizer from "
              "the target's folder; `--spec-draft-n-max` is at most the block size minus one):", "", "```bash",
              "python convert_hf_to_gguf.py DRAFTER_FOLDER --target-model-dir TARGET_HF_FOLDER \\",
              "    --outtype f32 --outfile drafter.gguf",
              f"llama-server -m target.gguf -md drafter.gguf --spec-type {variant.llama_cpp_spec_type} \\",
              f"    --spec-draft-n-max {block - 1}",
              "```"]
    if "draft_vocab_size" in config and not variant.llama_cpp_prunes_vocab:
        lines += ["", f"llama.cpp's converter does not read the pruned draft vocabulary (`d2t`) of a "
                  f"{variant.title} export: serve this one with vLLM."]
    return lines


def variant_of_config(config: dict[str, Any]) -> Variant:
    """The variant of an export's ``config.json`` dict, by its ``architectures``."""
    return variant_of(SimpleNamespace(architectures=config.get("architectures")))  # type: ignore[arg-type]


def model_card(config: dict[str, Any], *, num_params: int, run: RunFacts | None) -> str:
    """The ``README.md`` text of an export whose ``config.json`` is ``config``."""
    record = config.get(SIGNATURE_KEY) or {}
    variant = variant_of_config(config)
    section = config.get("dflash_config") or {}
    target, target_lines = _target_lines(record)
    block = config.get("block_size") or section.get("block_size")
    lines = [f"# {variant.title} drafter for {target}", "",
             f"A {variant.title} speculative-decoding drafter: a small block-diffusion model that drafts "
             f"{int(block) - 1} tokens at once from the hidden states of its frozen target, which verifies "
             "them, so the target's output is unchanged and decoding takes fewer target steps. It has no "
             "embedding and no LM head of its own: it runs only with the target below. Trained with "
             f"dflash-trainer {__version__}.", "", "## Target", "", *target_lines, "", "## Drafter", "",
             f"- variant: `{variant.name}` (`{variant.architecture}`)",
             f"- block size: {block} (an anchor and {int(block) - 1} drafts)",
             f"- layers: {config.get('num_hidden_layers')}, hidden size {config.get('hidden_size')}, MLP "
             f"{config.get('intermediate_size')}, {config.get('num_attention_heads')} attention heads / "
             f"{config.get('num_key_value_heads')} key-value heads",
             f"- tapped target layers: {section.get('target_layer_ids')}; mask token id "
             f"{section.get('mask_token_id')}",
             f"- parameters: {format_count(num_params)} ({num_params:,}), stored as {config.get('dtype')}"]
    if "draft_vocab_size" in config:
        lines.append(f"- draft vocabulary: the {config['draft_vocab_size']:,} most frequent tokens of the "
                     "training data (`d2t` maps them to the target's ids)")
    if run is not None:
        lines += ["", "## Training", "", *_training_lines(run), "", "## Evaluation", "",
                  *_eval_lines(run, target=target)]
    lines += ["", "## Serving", "", *_serving_lines(config, target=target), ""]
    return "\n".join(lines)


def write_model_card(folder: Path, *, run: RunFacts | None) -> Path:
    """(Re)write the ``README.md`` of the export in ``folder`` from its ``config.json`` and
    weights: after an evaluation that followed the export, so the card shows its tau."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # a safetensors handle, not a dict: it has no __iter__
        num_params = sum(math.prod(f.get_slice(k).get_shape()) for k in names
                         if f.get_slice(k).get_dtype().startswith(("F", "BF")))
    path = folder / CARD_FILE
    atomic_write_text(path, model_card(config, num_params=num_params, run=run))
    return path
