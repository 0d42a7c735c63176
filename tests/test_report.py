"""Run report: every plot is a real image, index.html shows them, partial runs do not crash."""

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import Config, save_config
from dflash_trainer.reporting.report import PLOTS, QUEUE_DEPTH, read_metrics, write_report
from dflash_trainer.training.trackers import JsonlTracker

BLOCK = 4


def synthetic_metrics(step: int) -> dict[str, float]:
    """Every DESIGN.md metric, with plausible trends."""
    progress = step / 100
    metrics = {
        "train/loss": 5.0 * math.exp(-2 * progress) + 0.1,
        "train/acc": 0.2 + 0.5 * progress,
        "train/tau_sim": 1.0 + 2.0 * progress,
        "train/grad_norm": 2.0 - progress,
        "train/grad_norm_max": 4.0 - progress,
        "train/lr": 6e-4 * min(1.0, step / 20),
        "train/skipped_nonfinite": 1.0 if step >= 50 else 0.0,  # a running total
        "train/tokens_total": 1000.0 * step,
        "train/samples_total": 8.0 * step,
        "data/seq_len_mean": 200 + 50 * math.sin(step),
        "data/seq_len_max": 400 + 80 * math.sin(step),
        "data/padding_efficiency": 0.85 + 0.1 * math.sin(step / 7),
        "data/max_same_bucket_run": 2.0,
        "pipe/queue/batches": float(step % 5),
        "pipe/queue/features": float(step % 3),
        "pipe/queue/features/put_wait_s": 0.01,  # channel wait times are not depths
        "pipe/prefetch/busy_frac": 0.3,
        "pipe/target/busy_frac": 0.6,
        "perf/tokens_per_s": 5000 + 100 * math.sin(step),
        "perf/samples_per_s": 40 + math.sin(step),
        "perf/data_wait_frac": 0.05,
        "perf/step_time_s": 0.2,
    }
    for k in range(1, BLOCK):
        metrics[f"train/acc_pos/{k}"] = (0.8 - 0.15 * k) * (0.5 + 0.5 * progress)
    for i in range(3):
        metrics[f"data/bucket/{i}/dispatched"] = step / (i + 1)
    return metrics


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    save_config(Config(run_dir=str(run)), run)
    tracker = JsonlTracker(run / "metrics.jsonl")
    tracker.log({"eval/tau": 1.0, "eval/lossless": 1.0}, 0)  # the untrained drafter
    for step in range(10, 101, 10):
        # Ten micro-batches per window, cycling through the three buckets.
        tracker.log({**synthetic_metrics(step), "data/step_buckets": [(step + i) % 3 for i in range(10)]}, step)
        if step % 50 == 0:
            tracker.log({"eval/tau": 1.5 + step / 100, "eval/acceptance_hist": [5, 3, 2, 1]},
                        step)
    tracker.close()
    (run / "eval").mkdir()
    (run / "eval" / "mtbench.json").write_text(json.dumps({
        "tau": 2.75, "acceptance_hist": [10, 20, 15, 5], "speedup": 2.1,
        "prompts": [{"id": 1, "tau": 2.5}, {"id": 2, "tau": 3.0}]}))
    return run


def assert_real_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0, path
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width > 100 and image.height > 100
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 2, f"{path.name} is a flat image"


@pytest.mark.slow
def test_full_run_report(run_dir: Path):
    index = write_report(run_dir)
    assert index == run_dir / "report" / "index.html"
    text = index.read_text()
    for plot in PLOTS:
        assert_real_png(run_dir / "report" / plot.file)
        assert f'src="{plot.file}"' in text
    assert len(PLOTS) == 12
    assert set(re.findall(r'src="([^"]+)"', text)) == {p.file for p in PLOTS}
    # Summary: final values, eval tau from the eval file, steps, tokens, and the config.
    final = synthetic_metrics(100)
    assert f"<th>final loss</th><td>{final['train/loss']:.4g}</td>" in text
    assert "<th>eval tau</th><td>2.75</td>" in text
    assert "<th>steps</th><td>100</td>" in text
    assert "<th>tokens</th><td>100,000</td>" in text
    assert "<th>steps skipped (non-finite)</th><td>1</td>" in text
    assert "wall time" in text and "speedup" in text and "prompts</th><td>2 entries" in text
    assert "tokens_per_batch: 4096" in text  # the config.yaml is shown


def test_queue_plot_shows_depths_only(run_dir: Path):
    log = read_metrics(run_dir / "metrics.jsonl")
    assert list(log.family(QUEUE_DEPTH)) == ["batches", "features"]


@pytest.mark.slow
def test_missing_metrics_give_placeholders(tmp_path: Path):
    run = tmp_path / "run"
    tracker = JsonlTracker(run / "metrics.jsonl")
    tracker.log({"train/loss": 3.0}, 1)
    tracker.close()
    index = write_report(run)
    for plot in PLOTS:
        assert_real_png(run / "report" / plot.file)  # "no data" text is not a flat image
    text = index.read_text()
    assert "No config.yaml" in text and "No eval results" in text


def test_resume_and_cut_lines_are_resolved_and_reported(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": 10, "train/loss": 3.0}),
             json.dumps({"step": 20, "train/loss": 2.0}),
             # Abandoned: logged after the step-20 checkpoint, then the run crashed ...
             json.dumps({"step": 30, "train/loss": 9.9, "train/acc": 0.9}),
             json.dumps({"step": 40, "train/loss": 9.9}),
             '{"step": 40, "train/lo',  # ... mid-line
             # ... and resumed from step 20.
             json.dumps({"step": 30, "train/loss": 1.5}),
             json.dumps({"step": 30, "eval/tau": 2.0}),
             json.dumps({"step": 40, "train/loss": 1.0})]
    path.write_text("\n".join(lines) + "\n")
    log = read_metrics(path)
    assert log.series("train/loss") == ([10, 20, 30, 40], [3.0, 2.0, 1.5, 1.0])
    assert log.series("train/acc") == ([], [])
    assert log.series("eval/tau") == ([30], [2.0])
    assert log.bad_lines == [5]
    assert log.rewinds == 1


@pytest.mark.slow
def test_cli_report_command(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    assert cli_main(["report", str(run_dir)]) == 0
    assert "report written to" in capsys.readouterr().out
    assert (run_dir / "report" / "index.html").is_file()
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def traced_request(prompt_id: str) -> dict:
    """A per_prompt entry as ``dflash-trainer eval`` writes it (see evaluate.acceptance_trace)."""
    trace = [{"step": 0, "drafted": [], "accepted": 0, "tokens": 1, "text": "", "bonus": "The", "rejected": ""},
             {"step": 1, "drafted": [5, 6, 7], "accepted": 3, "tokens": 4, "text": " cat sat on",
              "bonus": " the", "rejected": ""},
             {"step": 2, "drafted": [8, 9, 9], "accepted": 1, "tokens": 2, "text": " <mat>", "bonus": ".",
              "rejected": " dog dog"},
             {"step": 3, "drafted": [1, 2, 3], "accepted": 0, "tokens": 1, "text": "", "bonus": "\n",
              "rejected": "x y z"}]
    return {"id": prompt_id, "turn": 0, "prompt_text": "Where did the cat sit?", "tokens": 8, "steps": 3,
            "tau": 8 / 3, "lossless": True, "trace": trace}


@pytest.mark.slow
def test_first_screen_answers_and_captions(run_dir: Path):
    folder = run_dir / "eval" / "mtbench-full"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({
        "tau": 2.5, "acceptance_hist": [1, 1, 0, 1], "lossless": True,
        "per_prompt": [traced_request(f"q{i}") for i in range(6)]}))
    text = write_report(run_dir).read_text()
    first = text.index("Did it work?")
    # Untrained (in-training eval at step 0) -> trained (the first eval file), lossless, and the
    # loss and tau plots side by side before anything else.
    assert "1.00 \u2192 2.75" in text and "lossless</div><div class='value'>yes" in text
    assert first < text.index('src="loss.png"') < text.index('src="tau.png"') < text.index("Answers")
    # Four answers with the accepted spans marked by how many were accepted, the bonus plain.
    assert text.count("<div class='answer'>") == 4
    assert ("<span class='acc a2' title='step 1: 3 of 3 drafts accepted; rejected: &#x27;&#x27;'>"
            " cat sat on</span> the") in text
    assert "<span class='acc a1'" in text and " &lt;mat&gt;</span>." in text
    assert "rejected: &#x27; dog dog&#x27;" in text
    assert "<td>q5</td><td>1</td><td>2.67</td><td>8</td><td>3</td><td>yes</td>" in text  # all six in the table
    assert "Highlighted: draft tokens the target accepted" in text
    # Every grid plot says what healthy looks like; the same-bucket run names its bound.
    assert text.count("Healthy: ") == len(PLOTS)
    assert "2 (configured max_run 2, order interleave" in text


@pytest.mark.slow
def test_speedup_shows_its_reliability(run_dir: Path):
    """A speedup the evaluation marked unreliable says so on the first screen and in the
    evaluation table; one from a file without the mark (older runs) says it was not recorded."""
    reasons = ["busy: load 2.3 from other work beside 2 eval threads on 2 cores"]
    (run_dir / "eval" / "mtbench.json").write_text(json.dumps({
        "tau": 1.28, "acceptance_hist": [10, 5, 1, 0], "speedup": 0.7849, "speedup_reliable": False,
        "speedup_unreliable_reasons": reasons,
        "speedup_measurement": {"pairs": 8, "torch_threads": 2, "cpus": 2, "load_1m_before": 0.4,
                                "load_1m_after": 4.3, "step_cost_scatter": 1.1, "scatter_bound": 1.5},
        "untrained_speedup": 0.41, "untrained_speedup_reliable": True, "untrained_speedup_unreliable_reasons": []}))
    (run_dir / "eval" / "old.json").write_text(json.dumps({"tau": 1.2, "speedup": 6.473}))
    text = write_report(run_dir).read_text()
    assert ("decode speedup</div><div class='value'>0.78 (unreliable)</div><div class='note'>unreliable: "
            f"{reasons[0]} (eval/mtbench)") in text
    assert f"<th>speedup</th><td>0.78 (unreliable: {reasons[0]})</td>" in text
    assert "<th>untrained_speedup</th><td>0.41</td>" in text
    assert ("<th>speedup_measurement</th><td>8 prompts side by side in alternating order, 2 torch threads on 2 "
            "cores, 1-min load 0.40 before and 4.30 after, step-cost scatter 1.10x (bound 1.5x)</td>") in text
    assert "<th>speedup</th><td>6.47 (reliability not recorded)</td>" in text
    assert "speedup_unreliable_reasons" not in text  # folded into the speedup row


@pytest.mark.slow
def test_bucket_strip_places_every_micro_batch(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 2, "train/loss": 3.0, "data/step_buckets": [0, 1]},
             {"step": 4, "train/loss": 2.0, "data/step_buckets": [2, 2, 1, 0]},  # grad_accum 2
             {"step": 6, "train/loss": 1.5},  # an older writer: no list
             {"step": 8, "train/loss": 1.0, "data/step_buckets": [1, 1]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    edges, buckets = read_metrics(path).step_buckets()
    assert edges == [0, 1, 2, 2.5, 3, 3.5, 4, 6, 7, 8]
    assert buckets == [0, 1, 2, 2, 1, 0, -1, 1, 1]  # -1: the gap without ids
    index = write_report(tmp_path)
    assert_real_png(tmp_path / "report" / "loss.png")
    assert "Did it work?" in index.read_text()


@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="no Chromium-family browser installed")
@pytest.mark.slow
def test_report_renders_in_a_headless_browser(run_dir: Path, tmp_path: Path):
    index = write_report(run_dir)
    out = tmp_path / "shot.png"
    script = Path(__file__).resolve().parents[1] / "tools" / "render_report.py"
    done = subprocess.run([sys.executable, str(script), str(index), str(out), "--width", "1200", "--height", "900"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert_real_png(out)
    with Image.open(out) as image:
        assert image.size == (1200, 900)
        pixels = np.asarray(image.convert("RGB")).astype(int)
    # The first screen holds the two headline plots: the left and right halves both carry
    # drawing, not one column with blank space beside it.
    lower = pixels[300:900]
    for half in (lower[:, :600], lower[:, 600:]):
        assert (half.sum(axis=2) < 600).mean() > 0.01
    # The green "good" card of the lossless check is rendered (CSS applied).
    assert ((pixels[..., 0] == 0xf3) & (pixels[..., 1] == 0xfb) & (pixels[..., 2] == 0xf3)).any()


def test_the_headline_tau_names_what_it_was_measured_on(tmp_path: Path):
    from dflash_trainer.reporting.report import EvalResult, verdict

    demo = EvalResult(name="results", data={"tau": 1.262, "prompts": "mtbench", "num_prompts": 8,
                                            "max_new_tokens": 64})
    assert demo.measured_on == "8 mtbench prompts x 64 tokens"
    plain = EvalResult(name="code", data={"tau": 1.2, "prompts_source": "humaneval", "prompts": 20,
                                          "max_new_tokens": 128})
    assert plain.measured_on == "20 humaneval prompts x 128 tokens"
    suite = EvalResult(name="suite", data={"tau": 1.1, "prompts_source": "suite",
                                           "domains": {"mtbench": {"tau": 1.2}, "math": {"tau": 1.0}}})
    assert suite.measured_on == "suite: mtbench, math"
    assert EvalResult(name="old", data={"tau": 1.0}).measured_on is None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 2.0}) + "\n")
    log = read_metrics(tmp_path / "metrics.jsonl")
    assert verdict(log, [demo]).trained_source == "eval/results, 8 mtbench prompts x 64 tokens"
