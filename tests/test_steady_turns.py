"""What ``benchmarks.steady_turns`` reads to compare the two engines: the turns' own times
in a llama-server log, and the host's engine argv to start the bare engine with."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.steady_turns import _engine_argv, _turn_timings

LOG = """\
0.06.496.915 I slot launch_slot_: id  1 | task 110 | processing task
0.06.558.491 I slot print_timing: id  1 | task 110 | prompt eval time =      41.49 ms /    24 tokens
0.06.558.499 I slot print_timing: id  1 | task 110 |        eval time =      20.05 ms /     4 tokens
0.06.558.500 I slot print_timing: id  1 | task 110 |       total time =      61.53 ms /    28 tokens
0.07.012.001 I slot print_timing: id  0 | task 115 | prompt eval time =     812.00 ms /  1000 tokens
0.07.012.002 I slot print_timing: id  0 | task 115 |        eval time =       0.00 ms /     1 tokens
0.07.558.491 I slot print_timing: id  1 | task 120 | prompt eval time =      43.00 ms /    24 tokens
0.07.558.499 I slot print_timing: id  1 | task 120 |        eval time =      15.33 ms /     4 tokens
"""


def test_turn_timings_are_the_turns_own_and_skip_other_requests() -> None:
    prompt, answer = _turn_timings(LOG)
    assert prompt == [41.49, 43.0]  # the 1,000-token warm-up is not a turn
    assert answer == [20.05, 15.33]


def test_the_bare_engine_gets_the_hosts_argv_on_its_own_port_without_saves(
    tmp_path: Path,
) -> None:
    argv = ["llama-server", "--model", "m.gguf", "--port", "4100", "--slot-save-path"]
    argv += ["/s/slots/small", "--cache-ram", "0", "--batch-size", "512"]
    log = tmp_path / "host.log"
    log.write_text(
        json.dumps({"msg": "serving"})
        + "\n"
        + json.dumps({"event": "engine_starting", "argv": argv})
        + "\n"
    )
    assert _engine_argv(log, 5200) == [
        "llama-server",
        "--model",
        "m.gguf",
        "--port",
        "5200",
        "--cache-ram",
        "0",
        "--batch-size",
        "512",
    ]
