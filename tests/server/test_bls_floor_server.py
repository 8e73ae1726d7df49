"""tools/bls_floor.py against a real tritonserver: every call is timed (the engine's
sleep taken out), and the stack's processes are found and charged."""

import pytest

from tools import bls_floor


@pytest.mark.slow
def test_the_floor_of_a_bls_call_is_measured():
    lines = []
    result = bls_floor.measure(40, [16, 300], [0, 2], progress=lines.append)
    assert [(row["context_tokens"], row["engine_ms"]) for row in result["results"]] == [(16, 0), (16, 2), (300, 0),
                                                                                          (300, 2)]
    for row in result["results"]:
        assert row["calls"] == 40 and 0 < row["p10_ms"] <= row["p50_ms"] <= row["p90_ms"] < 1000
        assert set(row["cpu_ms_per_call"]) == {"tritonserver", "caller", "echo"}
        assert all(value >= 0 for value in row["cpu_ms_per_call"].values())
    assert len(lines) == 4 and "beyond the engine's time p50" in lines[0]
