"""The package as users install it: the wheel's contents (modeling files, the shipped configs,
the license), the command line run from the installed wheel outside the repository,
``--version``, and ``--help`` of the commands that read no config."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import with_guard
from dflash_trainer import __version__
from dflash_trainer.cli.main import build_parser
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_version_names_the_package_and_its_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--version"])
    assert exit_info.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"dflash-trainer {__version__} (torch "), line
    assert "transformers " in line


@pytest.mark.parametrize("command", ["export", "report"])
def test_commands_without_a_config_list_only_their_own_options(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = sub.format_help()
    assert "config options" not in text and "training.lr" not in text and "--config" not in text, text
    assert "KEY=VALUE" not in text


def test_a_command_without_a_config_refuses_an_override(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--checkpoint", "ckpt", "--out", "out", "training.lr=1e-3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: training.lr=1e-3" in capsys.readouterr().err


def test_train_help_still_lists_the_config_options() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["train"]
    assert "training.lr = 0.0006" in sub.format_help()


@pytest.mark.parametrize("name", ["demo-cpu", "demo-cpu.yaml", "configs/demo-cpu.yaml"])
def test_a_shipped_config_is_found_by_name_from_any_folder(name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(name).run_dir == load_config(REPO / "configs" / "demo-cpu.yaml").run_dir == "runs/demo"


def test_a_local_file_wins_over_a_shipped_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-cpu.yaml").write_text("run_dir: mine\n")
    assert load_config("demo-cpu.yaml").run_dir == "mine"


@pytest.mark.slow
def test_the_wheel_ships_configs_license_and_a_working_cli(tmp_path: Path) -> None:
    """``pip wheel`` of the repository (no editable install), unpacked outside it: the console
    script's module runs ``--version`` and loads a shipped config by name from an empty folder."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("dflash_trainer-*.whl")
    assert wheel.name.startswith(f"dflash_trainer-{__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("dflash_trainer/configs/")) == shipped
    assert "dflash_trainer/model/modeling/dflash.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dflash-trainer = dflash_trainer.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": with_guard(str(site))}
    script = ("import sys; from dflash_trainer.cli.main import main; from dflash_trainer.config import load_config; "
              "import dflash_trainer; assert dflash_trainer.__file__.startswith(sys.argv[1]), dflash_trainer.__file__; "
              "print(load_config('demo-cpu.yaml').model.num_layers); main(['--version'])")
    run = subprocess.run([sys.executable, "-c", script, str(site)], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "2" and f"dflash-trainer {__version__} " in run.stdout
