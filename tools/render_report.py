"""Render a run report's index.html to PNG in headless Chromium (what a reader's browser shows).

    python tools/render_report.py RUN_DIR/report/index.html out.png [--width 1400] [--height 1800]

Chromium (Debian's ``chromium`` package, or Google Chrome) must be on PATH. The screenshot is
the top ``height`` pixels of the page at a ``width``-pixel window: the report's first screen
and what follows it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    """The first Chromium-family browser on PATH, or None."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def render(index: Path, out: Path, *, width: int = 1400, height: int = 1800,
           browser: str | None = None, timeout_s: float = 120.0) -> Path:
    """Screenshot ``index`` into ``out`` (PNG); raises RuntimeError when the browser fails."""
    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError(f"no Chromium-family browser on PATH (tried {', '.join(BROWSERS)}); "
                           "install one, e.g. `apt-get install chromium`")
    index = Path(index).resolve()
    if not index.is_file():
        raise RuntimeError(f"{index} does not exist; write it with `dflash-trainer report RUN_DIR`")
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:  # no state shared with another browser
        command = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                   "--no-first-run", f"--user-data-dir={profile}", "--allow-file-access-from-files",
                   f"--window-size={width},{height}", f"--screenshot={out}", index.as_uri()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{browser} exited with {done.returncode} without writing {out}:\n"
                           f"{done.stderr[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", type=Path, help="report/index.html of a run")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1800)
    args = parser.parse_args(argv)
    try:
        path = render(args.index, args.out, width=args.width, height=args.height)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"render_report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
