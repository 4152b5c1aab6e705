"""Install the real clients the suite drives, at the versions in :data:`._clients.PINS`,
under :func:`._clients.clients_dir`; what is already there at its pin is left alone.

``tox -e tests`` runs this before the tests (``python -m tests.install_clients``), so the
README's test command needs nothing installed by hand but ``node``/``npm``. The npm
clients go in with ``npm install --prefix``; aider gets a venv of its own (its
dependencies are pinned hard, so it never shares the test environment). Measured on 2
cores: npm about 40 s, aider about 3 min, each once per machine.
"""

from __future__ import annotations

import subprocess
import sys
import venv

from ._clients import PINS, clients_dir, installed_version


def _missing() -> dict[str, tuple[str, str, str]]:
    wrong = {}
    for name, pin in PINS.items():
        try:
            ok = installed_version(name) == pin[2]
        except (OSError, ValueError, KeyError):
            ok = False
        if not ok:
            wrong[name] = pin
    return wrong


def main() -> int:
    base = clients_dir()
    base.mkdir(parents=True, exist_ok=True)
    missing = _missing()
    npm = [f"{package}@{version}" for kind, package, version in missing.values() if kind == "npm"]
    if npm:
        print(f"installing {' '.join(npm)} under {base}", flush=True)
        subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(base),
                "--no-save",
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                *npm,
            ],
            check=True,
        )
    for kind, package, version in missing.values():
        if kind != "pypi":
            continue
        env_dir = base / package.split("-")[0]
        print(f"installing {package}=={version} in its own venv {env_dir}", flush=True)
        venv.EnvBuilder(clear=True, with_pip=True).create(env_dir)
        subprocess.run(
            [
                str(env_dir / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                f"{package}=={version}",
            ],
            check=True,
        )
    still = _missing()
    if still:
        print(f"not installed at their pins: {', '.join(still)}", file=sys.stderr)
        return 1
    print(f"clients ready under {base}: {', '.join(PINS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
