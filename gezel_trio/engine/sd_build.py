"""Build stable-diffusion.cpp's ``sd-server`` (the image engine) for this CPU.

No wheel ships sd-server, so ``gezel-trio build-engine`` compiles it when none is
usable: the sources are the ones vendored in the ``stable-diffusion-cpp-python``
sdist (``vendor/stable-diffusion.cpp``), configured with ``-DSD_BUILD_EXAMPLES=ON``
for the native CPU, and only the ``sd-server`` target is built (a static binary).
It is installed with a ``gezel-sd-build.json`` beside it, the way the llama-server
build records its facts, where :func:`gezel_trio.engine.binary.resolve_sd_server`
finds it.

Left out of the build: the web UI (it needs pnpm), WebP and WebM output (PNG and
JPEG remain).

Blocking code: it runs before the event loop (a CLI command, or CI setup).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .build import data_dir, fetch_sdist, install_dir, run_step

SD_BUILD_METADATA_FILE = "gezel-sd-build.json"
SD_ENGINE = "stable-diffusion-cpp"
SD_SERVER = "sd-server"

SD_SOURCE_PACKAGE = "stable-diffusion-cpp-python"
SD_SOURCE_VERSION = "0.4.7"
SD_SOURCE_SUBDIR = "vendor/stable-diffusion.cpp"

SD_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DSD_BUILD_EXAMPLES=ON",
    "-DGGML_NATIVE=ON",
    "-DSD_SERVER_BUILD_FRONTEND=OFF",
    "-DSD_WEBP=OFF",
    "-DSD_WEBM=OFF",
)


def sd_revision(version: str = SD_SOURCE_VERSION) -> str:
    """The build's revision: the sdist carries no git history, so its package version
    names the vendored sources."""
    return f"{SD_SOURCE_PACKAGE}-{version}"


def built_sd_server_dir(version: str = SD_SOURCE_VERSION) -> Path:
    return data_dir() / "engines" / f"sd-cpp-{version}-cpu-native"


def built_sd_server_path(version: str = SD_SOURCE_VERSION) -> Path:
    return built_sd_server_dir(version) / SD_SERVER


def build_sd_server(
    *, version: str = SD_SOURCE_VERSION, jobs: int | None = None, source_dir: Path | None = None
) -> Path:
    """Compile sd-server for this CPU and install it; returns the binary path.

    ``source_dir``: an unpacked stable-diffusion.cpp tree to build instead of the sdist's.
    """
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix="gezel-sd-build-") as tmp_s:
        tmp = Path(tmp_s)
        if source_dir is None:
            source_dir = fetch_sdist(SD_SOURCE_PACKAGE, version, tmp) / SD_SOURCE_SUBDIR
        build = tmp / "build"
        log = tmp / "build.log"
        run_step(["cmake", "-S", str(source_dir), "-B", str(build), *SD_CMAKE_FLAGS], log=log)
        run_step(["cmake", "--build", str(build), "--target", SD_SERVER, f"-j{jobs}"], log=log)
        return install_sd_build(build / "bin", version=version)


def install_sd_build(bin_dir: Path, *, version: str = SD_SOURCE_VERSION) -> Path:
    """Copy a finished build's ``sd-server`` into the data dir, with
    ``gezel-sd-build.json`` beside it; returns the installed binary's path."""
    target = built_sd_server_dir(version)
    install_dir(
        target,
        lambda staging: shutil.copy2(bin_dir / SD_SERVER, staging / SD_SERVER),
        metadata_file=SD_BUILD_METADATA_FILE,
        engine=SD_ENGINE,
        revision=sd_revision(version),
    )
    return target / SD_SERVER
