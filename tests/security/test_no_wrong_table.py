"""No silently wrong table: compare's --rounds against a train.rounds grid, a truncated results.csv under
audit, a section given as a scalar, and the two unhelpful messages."""

from __future__ import annotations

import pytest
import yaml
from conftest import tiny_config

from raysim.build import build_config, config_from_cli
from raysim.engine.loop import run
from raysim.errors import ConfigError, DataError
from raysim.storage.runfolder import RunFolder
from raysim.tools.audit import main as audit_main
from raysim.tools.compare import main as compare_main
from raysim.tools.compare import spec_from_args


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return next(ln for ln in err.splitlines() if ln.startswith("error:"))


def test_compare_refuses_rounds_together_with_a_rounds_grid(tmp_path, capsys):
    rc = compare_main(["--methods", "promptfl", "--grid", "train.rounds=1,3", "--rounds", "2", "--dry-run", "--out", str(tmp_path / "c")])
    line = error_line(capsys)
    assert rc == 2 and "--grid train.rounds=1,3" in line and "--rounds" in line
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"methods": ["promptfl"], "rounds": 2, "grid": {"train.rounds": [1, 3]}}))
    assert compare_main([str(spec), "--dry-run"]) == 2 and "spec's rounds" in error_line(capsys)
    spec, _ = spec_from_args(["--methods", "promptfl", "--grid", "train.rounds=1,3"])  # the grid alone: each column its rounds
    assert spec.rounds == 0 and spec.grid == {"train.rounds": [1, 3]}


def test_a_dotted_key_in_a_compare_setting_is_read_as_its_section(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"methods": ["promptfl"], "setting": {"data.dataset": "synthetic-small", "train.rounds": 2}}))
    s, _ = spec_from_args([str(spec)])
    assert s.setting["data"]["dataset"] == "synthetic-small" and s.setting["train"]["rounds"] == 2
    assert build_config({"data.dataset": "synthetic-small"}).data.dataset == "synthetic-small"
    with pytest.raises(ConfigError) as e:
        build_config({"data.datset": "digits"})
    assert "Did you mean data.dataset?" in str(e.value)


def test_a_method_without_options_says_so_instead_of_listing_no_keys(capsys):
    with pytest.raises(ConfigError) as e:
        build_config({"promptfl": {"nosuchopt": 1}})
    assert "Valid keys: ." not in str(e.value) and "promptfl takes no keys" in str(e.value)
    rc = compare_main(["--methods", "promptfl:nosuchopt=1", "--dry-run", "--out", "/nonexistent/never-written"])
    line = error_line(capsys)
    assert rc == 2 and "promptfl.nosuchopt" in line and "Valid keys: ." not in line


@pytest.mark.parametrize("section", ["train", "dp", "data", "output"])
def test_a_section_given_as_a_scalar_is_refused_even_when_the_command_line_sets_its_keys(tmp_path, section):
    f = tmp_path / "cfg.yaml"
    f.write_text(f"{section}: 5\n")
    with pytest.raises(ConfigError, match=f"{section} is a section"):
        config_from_cli(str(f), [f"{section}.nosuch=1" if section != "train" else "train.rounds=2"])
    with pytest.raises(ConfigError, match=f"{section} is a section"):
        config_from_cli(str(f), [])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("recorded")
    return run(tiny_config(tmp, cache_dir, train={"rounds": 3}, output={"record_uploads": True})).out_dir


def test_audit_refuses_a_truncated_results_csv(recorded, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(recorded, out)
    assert RunFolder(out).utility()  # intact: the summary is there
    csv = out / "results.csv"
    lines = csv.read_bytes().splitlines(keepends=True)
    csv.write_bytes(b"".join(lines[:-1]))  # the last round's row is gone: a whole-line cut
    with pytest.raises(DataError, match=r"truncated: the run completed rounds 0 to 2 .* round\(s\) 2"):
        RunFolder(out).utility()
    assert audit_main([str(out)]) == 2 and "truncated" in error_line(capsys)
    csv.write_bytes(b"".join(lines)[:-7])  # cut in the middle of the last row
    with pytest.raises(DataError, match="last line is cut short"):
        RunFolder(out).utility()
    assert not (out / "audit.md").exists()
