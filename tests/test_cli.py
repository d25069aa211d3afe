"""The command line, run in-process on the CPU."""

import pytest

from weightstream.cli import main


def test_demo_runs_on_the_cpu_and_reports_identical_tokens(capsys):
    assert main(["demo", "--device", "cpu", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "synchronous backend" in out
    assert "tokens identical to the fully resident run: yes" in out
    assert "streamed" in out


def test_demo_rejects_a_bad_fraction():
    with pytest.raises(SystemExit):
        main(["demo", "--fraction", "1.5"])
