"""A cached CPU build of llama.cpp's ``llama-server``, from the source vendored in a pinned PyPI sdist.

llama.cpp has no wheel of its own on PyPI; the sdist of ``llama-cpp-python`` vendors a complete
llama.cpp (``vendor/llama.cpp``: the server, ``src/models/dflash.cpp`` and
``convert_hf_to_gguf.py``). The build goes into a folder of its own (default
``$XDG_CACHE_HOME/dflash-trainer/llama-cpp``, outside the work tree, so that every clone on the
machine, CI's included, reuses it), once: a stamp holding the pin and the build options marks
a finished build, so a pin or option change rebuilds. Every command's output is appended to
``FOLDER/build.log``; a failed step raises :class:`BuildError` naming the step and the log.

Two snags of the sdist: ``vendor/llama.cpp/.git`` is a stale gitlink file (cmake's version
probe then re-runs on every build, and ninja loops "still dirty"), so it is removed; and the
web UI and OpenSSL options are off, since nothing here can fetch their dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

SDIST_PIN = "llama-cpp-python==0.3.36"
TARGETS = ("llama-server",)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that keep ``-march=native`` from enabling ggml's AMX kernels. On an AMX Xeon
whose host does not keep the tile state (a virtualised one), this pin's ``llama-server`` dies
with SIGILL at its first ``tilezero`` while loading a Q4_1 model; the AVX-512 path runs
everywhere. GCC and Clang let an explicit ``-mno-*`` win over ``-march=native`` in any order."""
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF",
                 *((f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
                   if platform.machine().lower() in ("x86_64", "amd64") else ()))
STAMP = ".build-finished"


class BuildError(RuntimeError):
    """llama.cpp could not be fetched or built; the message names the step and the log."""


def stamp_content() -> str:
    """What the stamp of a finished build holds: the pin, targets and options."""
    return json.dumps({"sdist": SDIST_PIN, "targets": list(TARGETS), "cmake": list(CMAKE_OPTIONS)})


def default_folder() -> Path:
    """The shared build folder in the user cache directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dflash-trainer" / "llama-cpp"


def source_dir(folder: Path) -> Path:
    """The vendored llama.cpp source inside ``folder`` (``convert_hf_to_gguf.py`` lives there)."""
    return folder / "src" / "vendor" / "llama.cpp"


def binary(folder: Path, name: str = "llama-server") -> Path:
    """Path of a built llama.cpp program."""
    return folder / "build" / "bin" / name


def is_built(folder: Path) -> bool:
    """Whether ``folder`` holds a finished build of the current pin and options."""
    stamp = folder / STAMP
    return (stamp.is_file() and stamp.read_text() == stamp_content()
            and all(binary(folder, t).is_file() for t in TARGETS))


def _run(name: str, command: list[str], log_file, *, cwd: Path | None = None) -> None:
    log_file.write(f"\n$ {' '.join(command)}\n")
    log_file.flush()
    code = subprocess.call(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           cwd=cwd)
    if code != 0:
        log_file.flush()
        tail = "\n".join(Path(log_file.name).read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"llama.cpp build: step '{name}' failed with exit code {code}; "
                         f"see {log_file.name}:\n{tail}")


def _download(download: Path, log_file) -> Path:
    """The pinned sdist, downloaded into the fresh folder ``download``."""
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    _run("download sdist", [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--disable-pip-version-check", "-d", str(download), SDIST_PIN], log_file)
    archives = sorted(download.glob("*.tar.gz"))
    if len(archives) != 1:
        raise BuildError(f"llama.cpp build: expected one sdist in {download}, found {len(archives)}")
    return archives[0]


TEMPLATES = "vendor/llama.cpp/models/templates"
"""Where the sdist holds llama.cpp's published model chat templates (``*.jinja``)."""


def chat_templates(cache: Path, build: Path | None = None) -> Path:
    """The folder of llama.cpp's model chat templates from the pinned sdist: the build's source
    when ``build`` holds one, else ``cache/llama-cpp-python-<version>/`` (only the templates are
    extracted, once, and the folder appears complete or not at all). Raises :class:`BuildError`."""
    if build is not None and (source_dir(build) / "models" / "templates").is_dir():
        return source_dir(build) / "models" / "templates"
    folder = cache / SDIST_PIN.replace("==", "-")
    if folder.is_dir():
        return folder
    partial = cache / f"{folder.name}.partial-{os.getpid()}"
    partial.mkdir(parents=True, exist_ok=True)
    with open(partial / "download.log", "a", encoding="utf-8") as log_file:
        archive = _download(partial / "download", log_file)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                parent, _, name = member.name.partition("/")[2].rpartition("/")
                if parent == TEMPLATES and name.endswith(".jinja") and member.isfile():
                    (partial / name).write_bytes(tar.extractfile(member).read())
    shutil.rmtree(partial / "download")
    if not any(partial.glob("*.jinja")):
        raise BuildError(f"{SDIST_PIN}: no {TEMPLATES}/*.jinja in the sdist; see {partial / 'download.log'}")
    try:
        partial.rename(folder)  # complete or absent: a concurrent extraction may have won
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _unpack(folder: Path, log_file) -> None:
    archive = _download(folder / "download", log_file)
    download = archive.parent
    unpacked = folder / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    (root,) = list(unpacked.iterdir())
    shutil.rmtree(folder / "src", ignore_errors=True)
    root.rename(folder / "src")
    shutil.rmtree(unpacked)
    shutil.rmtree(download)
    gitlink = source_dir(folder) / ".git"
    if gitlink.is_file():
        gitlink.unlink()


def ensure_built(folder: Path, *, jobs: int | None = None, log: Callable[[str], None] = print) -> Path:
    """Build ``llama-server`` into ``folder`` unless a finished build is there; return its path."""
    folder = folder.resolve()
    if is_built(folder):
        log(f"llama.cpp: {binary(folder)} is built ({SDIST_PIN})")
        return binary(folder)
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "build.log"
    log(f"llama.cpp: building llama-server from {SDIST_PIN} into {folder} (8-15 minutes on 2 cores), "
        f"log {log_path}")
    started = time.monotonic()
    (folder / STAMP).unlink(missing_ok=True)
    jobs = jobs or os.cpu_count() or 1
    with open(log_path, "a", encoding="utf-8") as log_file:
        if not (source_dir(folder) / "CMakeLists.txt").is_file():
            _unpack(folder, log_file)
        build = folder / "build"
        _run("configure", ["cmake", "-S", str(source_dir(folder)), "-B", str(build), *CMAKE_OPTIONS], log_file)
        _run("build", ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                       "--target", *TARGETS], log_file)
    (folder / STAMP).write_text(stamp_content())
    log(f"llama.cpp: built in {time.monotonic() - started:.0f} s")
    return binary(folder)


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash_trainer.engines.llama_cpp_build [FOLDER]``: build (or find) llama-server;
    exit 1 on failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(default_folder()))
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        ensure_built(Path(args.folder), jobs=args.jobs)
    except BuildError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
