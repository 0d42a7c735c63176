"""Trackers that cannot start refuse the run before any work: W&B online without credentials,
an unreachable W&B host (a closed port on 127.0.0.1: no network), a TensorBoard folder that
cannot be written. One line naming the setting and the way out, through the real command line;
neither the target nor the data were touched (the token cache stays empty) and nothing is left
in the run folder."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import LoggingConfig
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.training.tracker_checks import check_trackers, wandb_base_url
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trackers")
    return {"target": make_tiny_target(root / "target", layers=2, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=8)}


@pytest.fixture
def no_wandb_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment where W&B finds no key and no host setting of the user's."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))


def closed_port() -> int:
    """A local port that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(assets: dict[str, Path], tmp_path: Path, *extra: str) -> int:
    return cli_main(["train", *tiny_run_overrides(target=assets["target"], data=assets["data"],
                                                  cache=tmp_path / "cache", run_dir=tmp_path / "run"), *extra])


def refused_before_any_work(tmp_path: Path, err: str, *, left: set[str] = frozenset()) -> str:
    """The one error line; the run folder holds only ``left``, the token cache nothing."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    run_dir = tmp_path / "run"
    assert not run_dir.exists() or {p.name for p in run_dir.iterdir()} == left
    assert not (tmp_path / "cache").exists(), "the data was prepared before the refusal"
    return lines[0]


def test_wandb_online_without_an_api_key(assets, tmp_path: Path, no_wandb_login: None, capsys):
    assert train(assets, tmp_path, "logging.wandb=online") == 2
    line = refused_before_any_work(tmp_path, capsys.readouterr().err)
    assert line == ("dflash-trainer train: config error: logging.wandb=online needs a W&B API key for "
                    "https://api.wandb.ai and none is set: run `wandb login` (or set WANDB_API_KEY), or log "
                    "offline with logging.wandb=offline (sync later with `wandb sync`)")


def test_wandb_online_with_an_unreachable_host(assets, tmp_path: Path, no_wandb_login: None, monkeypatch,
                                               capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert train(assets, tmp_path, "logging.wandb=online") == 2
    line = refused_before_any_work(tmp_path, capsys.readouterr().err)
    assert line.startswith(f"dflash-trainer train: config error: logging.wandb=online: the W&B host {url} "
                           "cannot be reached (")
    assert line.endswith("check the network or WANDB_BASE_URL, or log offline with logging.wandb=offline "
                         "(sync later with `wandb sync`)")


def test_a_tensorboard_folder_that_cannot_be_written(assets, tmp_path: Path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").write_text("not a folder")
    assert train(assets, tmp_path, "logging.tensorboard=true") == 1
    line = refused_before_any_work(tmp_path, capsys.readouterr().err, left={"tensorboard"})
    run_dir = tmp_path / "run"
    assert line == (f"dflash-trainer train: disk error: logging.tensorboard: cannot write {run_dir / 'tensorboard'}: "
                    f"{run_dir / 'tensorboard'} is not a folder; choose another run_dir, or turn TensorBoard "
                    "off with logging.tensorboard=false")


def test_the_wandb_host_and_key_come_from_where_wandb_reads_them(tmp_path: Path, no_wandb_login: None,
                                                                 monkeypatch):
    assert wandb_base_url() == "https://api.wandb.ai"
    settings = tmp_path / "home" / "wandb"
    settings.mkdir(parents=True)
    (settings / "settings").write_text("[default]\nbase_url = http://127.0.0.1:1/\n")
    assert wandb_base_url() == "http://127.0.0.1:1"
    # A key that `wandb login --host` wrote into the netrc file counts as credentials: the
    # check goes on to the host, which refuses the connection.
    (tmp_path / "home" / ".netrc").write_text("machine 127.0.0.1\n  login user\n  password " + "k" * 40 + "\n")
    with pytest.raises(ConfigError, match=r"the W&B host http://127.0.0.1:1 cannot be reached"):
        check_trackers(LoggingConfig(wandb="online", tensorboard=False), tmp_path / "run")
    assert not (tmp_path / "run").exists()
