"""The image engine's foundation, for real: the built (or the user's own) sd-server runs.

Nothing is built here: the binary resolves like the host's (``sd_server_binary``), and
without one the test fails with the resolver's message.
"""

from __future__ import annotations

import subprocess

from gezel_trio.engine.binary import EngineBinary


def test_sd_server_runs(sd_server_binary: EngineBinary) -> None:
    out = subprocess.run(
        [str(sd_server_binary.path), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=sd_server_binary.launch_env(),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--listen-port" in out.stdout + out.stderr
