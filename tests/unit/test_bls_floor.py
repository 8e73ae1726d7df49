"""tools/bls_floor.py: the least a BLS engine call costs on this host. The
server run is in tests/server/test_bls_floor_server.py (slow)."""

import pytest

from tools import bls_floor


def test_the_throwaway_models_are_valid_python():
    for code in (bls_floor.ECHO_MODEL, bls_floor.CALLER_MODEL):
        compile(code, "model.py", "exec")


def test_the_repository_has_both_models(tmp_path):
    bls_floor.write_repository(tmp_path)
    for name in ("echo", "caller"):
        assert f'name: "{name}"' in (tmp_path / name / "config.pbtxt").read_text()
        assert (tmp_path / name / "1" / "model.py").exists()
    echo = (tmp_path / "echo" / "config.pbtxt").read_text()
    assert "decoupled: true" in echo  # as the engines are
    assert all(f'name: "{name}"' in echo for name, _ in bls_floor.SCALARS)  # an engine call's inputs


def test_the_summary_is_in_milliseconds():
    row = bls_floor.summary([i / 1000 for i in range(1, 11)])
    assert row == {"calls": 10, "p10_ms": 2.0, "p50_ms": 5.5, "p90_ms": 10.0}


@pytest.mark.parametrize("argv, named", [(["--calls", "0"], "--calls"), (["--contexts", "200,0"], "--contexts"),
                                         (["--contexts", "many"], "--contexts"),
                                         (["--engine-ms", "7,x"], "--engine-ms"), (["--engine-ms", "-1"], "--engine-ms")])
def test_bad_options_are_refused_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        bls_floor.main(argv)
    assert exit_.value.code == 2 and named in capsys.readouterr().err
