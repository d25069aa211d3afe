"""The one result schema: validation names the bad field; every recorded file reads and validates."""

from __future__ import annotations

import os

import pytest

from weightstream.bench import schema

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


@pytest.mark.parametrize(
    "breakage, field",
    [
        (lambda d: d.pop("gpu"), "gpu"),
        (lambda d: d.update(weight_bytes="16GB"), "weight_bytes"),
        (lambda d: d["results"][0].update(exact="yes"), "results[0].exact"),
        (lambda d: d["results"][1].update(mode="fast"), "results[1].mode"),
        (lambda d: d["results"][2].pop("budget_bytes"), "results[2].budget_bytes"),
        (lambda d: d["results"][0].update(error="boom"), "results[0].median_ms"),
        (lambda d: d["results"][0].update(reps=True), "results[0].reps"),
    ],
)
def test_validate_names_the_bad_field(bench_doc, breakage, field):
    breakage(bench_doc)
    with pytest.raises(ValueError) as err:
        schema.validate(bench_doc)
    assert str(err.value).startswith(field + ":") or str(err.value).startswith(field + " ")


def test_write_json_round_trips_and_load_results_names_a_bad_file(bench_doc, tmp_path):
    path = str(tmp_path / "sub" / "doc.json")
    schema.write_json(bench_doc, path)
    assert schema.load_results([path]) == [bench_doc] and not os.path.exists(path + ".tmp")
    bench_doc["results"][0]["exact"] = "yes"
    schema.write_json(bench_doc, path)
    with pytest.raises(ValueError, match=r"doc\.json: results\[0\]\.exact"):
        schema.load_results([path])


def test_every_recorded_result_file_validates_and_the_validator_command_says_so(capsys):
    # the harness's documents, and the older scripts' converted to the schema; the single-purpose scripts
    # (bench_encdec, bench_codec, bench_quant) record their own fields beside them
    from weightstream.bench.index import result_files

    paths = result_files([RESULTS])
    assert len(paths) > 20, "no recorded results"
    assert schema.validate_files(paths) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(paths) and all(line.startswith("valid ") for line in out)


def test_the_validator_command_fails_on_a_bad_file(bench_doc, tmp_path, capsys):
    bench_doc.pop("gpu")
    path = str(tmp_path / "bad.json")
    schema.write_json(bench_doc, path)
    assert schema.validate_files([path]) == 1
    out = capsys.readouterr().out
    assert out.startswith("INVALID") and "bad.json: gpu: missing" in out
