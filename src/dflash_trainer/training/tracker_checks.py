"""Checks that the trackers a run asks for can start, made before any work (rank 0).

A tracker that fails when it is opened (W&B without an API key, a W&B host that does not
answer, a TensorBoard folder that cannot be written) would otherwise fail after the target
and the data were loaded and prepared, with a library traceback, leaving ``config.yaml`` and
an empty ``metrics.jsonl`` behind. :func:`check_trackers` refuses such a run first, in one line
that names the setting and the way out, and writes nothing into the run folder.
"""

from __future__ import annotations

import configparser
import netrc
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from dflash_trainer.config import LoggingConfig
from dflash_trainer.core.errors import ConfigError, DiskError

__all__ = ["WANDB_DEFAULT_HOST", "check_trackers", "wandb_base_url"]

WANDB_DEFAULT_HOST = "https://api.wandb.ai"
"""The W&B server a run talks to unless ``WANDB_BASE_URL`` or ``wandb login --host`` says otherwise."""

CONNECT_TIMEOUT_S = 5.0
"""How long the check waits for the W&B host to accept a connection."""

_OFFLINE = "or log offline with logging.wandb=offline (sync later with `wandb sync`)"


def _wandb_settings() -> configparser.ConfigParser:
    """W&B's own settings file (``wandb login --host`` writes the host there); empty if none."""
    folder = os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb"
    parser = configparser.ConfigParser()
    try:
        parser.read(Path(folder) / "settings")
    except (configparser.Error, OSError, UnicodeDecodeError):
        pass  # W&B itself reports a broken settings file when it starts
    return parser


def wandb_base_url() -> str:
    """The W&B server of this environment: ``WANDB_BASE_URL``, else the host of ``wandb login
    --host``, else :data:`WANDB_DEFAULT_HOST`."""
    url = os.environ.get("WANDB_BASE_URL") or _wandb_settings().get("default", "base_url", fallback=None)
    return (url or WANDB_DEFAULT_HOST).rstrip("/")


def _has_wandb_credentials(host: str) -> bool:
    """Whether W&B finds credentials for ``host`` without asking: ``WANDB_API_KEY``, an identity
    token file, or the key ``wandb login`` wrote into the netrc file."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = os.environ.get("NETRC") or Path.home() / ".netrc"
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _check_wandb_online() -> None:
    url = wandb_base_url()
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not _has_wandb_credentials(host):
        raise ConfigError(f"logging.wandb=online needs a W&B API key for {url} and none is set: run "
                          f"`wandb login` (or set WANDB_API_KEY), {_OFFLINE}")
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"logging.wandb=online: the W&B host {url} cannot be reached ({reason}); check the "
                          f"network or WANDB_BASE_URL, {_OFFLINE}") from None


def _check_writable(folder: Path, *, setting: str, way_out: str) -> None:
    """Refuse when ``folder`` cannot be created or written, probing its nearest existing parent
    with a file that is removed at once (so nothing is left behind, and a read-only file system
    is found also for root, whom permission bits do not stop)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise DiskError(f"{setting}: cannot write {folder}: {existing} is not a folder; {way_out}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise DiskError(f"{setting}: cannot write {folder} ({exc.strerror or exc}); {way_out}") from None


def check_trackers(cfg: LoggingConfig, run_dir: Path) -> None:
    """Refuse, in one line naming the setting and the way out, a tracker of ``cfg`` that cannot
    start in ``run_dir``: W&B online without credentials or with a host that does not accept a
    connection, a TensorBoard or W&B folder that cannot be written."""
    if cfg.tensorboard:
        _check_writable(run_dir / "tensorboard", setting="logging.tensorboard",
                        way_out="choose another run_dir, or turn TensorBoard off with logging.tensorboard=false")
    if cfg.wandb != "disabled":
        _check_writable(run_dir / "wandb", setting=f"logging.wandb={cfg.wandb}",
                        way_out="choose another run_dir, or turn W&B off with logging.wandb=disabled")
    if cfg.wandb == "online":
        _check_wandb_online()
