"""Hostile input at the command line, round two (issue 45, items 4, 6, 7, 8, 10, 11): YAML alias bombs, values
echoed whole, spec shapes, an unreachable cluster, a comparison of 10^6 runs, labels that collide or leave
--out, options between key=value, a full disk at the first write and in export-pfllib, Ctrl-C in compare.
Each ends with exit 2 (130 for Ctrl-C) and one line naming the file or key, and leaves nothing behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raysim.config.load import parse_yaml
from raysim.errors import SHOWN_CHARS, ConfigError, shown

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# nine aliases of nine aliases ... of a list, as one config value: 9^9 = 387,420,489 strings once walked, from
# 400 bytes (main before this fix: a MemoryError traceback after 98 s and 2.9 GB under a 6 GB cap)
BOMB = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x, x]"] + [
    f"&{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]) + "]"


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err and "Exception in thread" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith(("error:", "interrupted:"))]
    assert len(lines) == 1, err
    return lines


def one_line(capsys) -> str:
    return error_lines(capsys.readouterr().err)[0]


# -- 4: YAML aliases, and every echoed value bounded ----------------------------------------------------------

def test_an_alias_bomb_is_refused_by_every_front_door_in_bounded_memory(tmp_path):
    """run --config, compare SPEC and sweep FILE, in a process whose address space is capped 1 GiB above what
    its imports took: the bomb is refused at its first alias, one line naming the file (walked, as a config
    value echoed in a message, it would need tens of GB)."""
    for name, body in (("cfg.yaml", f"train:\n  ctx_init: {BOMB}\n"),
                       ("spec.yaml", f"methods: [promptfl]\nsetting: {{train: {{ctx_init: {BOMB}}}}}\n"),
                       ("sweep.yaml", f"space: {{train.seed: {{grid: [1]}}}}\nbase: {{train: {{ctx_init: {BOMB}}}}}\n")):
        (tmp_path / name).write_text(body)
    code = f"""
import resource, sys
from raysim.tools.cli import main
import raysim.tools.run, raysim.tools.compare, raysim.tools.sweep, raysim.build, raysim.engine.loop, raysim.tools.estimate
vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
d = {str(tmp_path)!r}
rcs = [main(['run', '--config', d + '/cfg.yaml']), main(['compare', d + '/spec.yaml', '--dry-run']),
       main(['sweep', d + '/sweep.yaml'])]
print('rcs', rcs)
"""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "rcs [2, 2, 2]" in out.stdout, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in out.stderr and len(lines) == 3, out.stderr
    for line, name in zip(lines, ("cfg.yaml", "spec.yaml", "sweep.yaml")):
        assert name in line and "aliases (*name) are not accepted (line 2, column" in line and len(line) < 300
    assert time.perf_counter() - t0 < 60  # the imports; the refusals themselves are instant
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "spec.yaml", "sweep.yaml"]  # nothing written


@FAST
@given(st.recursive(st.one_of(st.integers(), st.text("abc xyz-_.", max_size=5), st.booleans()),
                    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text("abc", min_size=1, max_size=3), c,
                                                                                  max_size=3)), max_leaves=8),
       st.sampled_from(["[*x, 1]", "*x", "{k: *x}", "{<<: *x, b: 1}"]))
def test_any_document_with_an_alias_is_refused_naming_its_place(value, use):
    """An anchor anywhere, then an alias anywhere (a value, an item, a merge key): a ConfigError naming `what`
    and the alias's line; the same document without the alias reads as before."""
    anchored = f"x: &x {json.dumps(value)}\n"  # JSON is YAML
    assert parse_yaml(anchored, what="F")["x"] == value
    with pytest.raises(ConfigError, match=r"^F: YAML aliases \(\*name\) are not accepted \(line 2, column \d+\)"):
        parse_yaml(anchored + f"y: {use}\n", what="F")


def test_no_yaml_reader_of_raysim_bypasses_the_no_alias_loader():
    """Every YAML read in raysim/ goes through raysim.config.load.parse_yaml (NoAliasLoader)."""
    pattern = re.compile(r"yaml\.(safe_load|load|full_load|unsafe_load|load_all|safe_load_all|compose)\(")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "raysim").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_a_config_yaml_with_a_repeated_value_reads_back():
    """config.yaml is dumped without anchors (the loader that reads it back refuses aliases)."""
    from raysim.build import build_config
    shared = ["a photo of a", "a picture of a"]
    cfg = build_config({"method": "promptfl", "train": {"rounds": 2}})
    d = cfg.to_dict()
    d["x"], d["y"] = shared, shared  # one object twice: the plain dumper would otherwise write &id001 / *id001
    import yaml

    from raysim.config.schema import _PlainDumper

    text = yaml.dump(d, Dumper=_PlainDumper)
    assert "&" not in text and parse_yaml(text, what="t")["y"] == shared
    assert parse_yaml(cfg.to_yaml(), what="config.yaml") == parse_yaml(cfg.to_yaml(), what="config.yaml")


@FAST
@given(st.one_of(st.text(min_size=0, max_size=3000), st.integers(min_value=-(10 ** 4000), max_value=10 ** 4000),
                 st.lists(st.text(max_size=200), max_size=300), st.dictionaries(st.text(max_size=50), st.text(max_size=500),
                                                                                max_size=50),
                 st.recursive(st.integers(), lambda c: st.lists(c, max_size=4), max_leaves=60)))
def test_shown_is_one_bounded_line_for_any_value(value):
    text = shown(value)
    assert len(text) <= SHOWN_CHARS and "\n" not in text
    if len(repr(value)) <= SHOWN_CHARS - 24 and isinstance(value, str):
        assert text == repr(value)  # a short string (a path, a name) is shown as it is
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        assert text.startswith(repr(value[:8])[:-1]) and "characters)" in text  # its head and its length


def test_a_huge_value_in_any_string_or_list_key_is_named_not_echoed():
    """Every str and list key of every section given a 1 MB string, then a 100,000-item list: what build_config
    says (when it refuses) is under 2,000 characters."""
    import dataclasses
    import typing

    from raysim.build import build_config
    from raysim.config.schema import SECTIONS

    huge_text, huge_list = "q" * 1_000_000, ["q"] * 100_000
    checked = 0
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            for value in (huge_text, huge_list):
                try:
                    build_config({"method": "promptfl", section: {f.name: value}})
                except ConfigError as e:
                    said = len(str(e))
                    del e  # pytest would print the whole message
                    assert said < 2000, f"{section}.{f.name}: {said:,} characters"
                    checked += 1
                except Exception as e:  # noqa: BLE001 - a key that is not ConfigError-checked would show here
                    raise AssertionError(f"{section}.{f.name}: {type(e).__name__}: {str(e)[:200]}") from None
    assert checked >= 40  # most keys refuse one of the two (the count keeps the loop honest)


# -- 6: tracebacks turned into one line --------------------------------------------------------------------

@pytest.mark.parametrize("body, want", [
    ("methods: [promptfl]\ngrid: 5\n", "grid is a mapping of config keys"),
    ("methods: [promptfl]\nrounds: abc\n", "rounds must be an integer, got 'abc'"),
    ("methods: [promptfl]\nrounds: -3\n", "rounds must be >= 1"),
    ("methods: 5\n", "each entry is 'name[:key=value;...]'"),
    ("methods: [{method: [1, 2]}]\n", "each entry is 'name[:key=value;...]'"),
    ("methods: [promptfl]\nseeds: [a, b]\n", "seeds: write integers"),
    ("methods: [promptfl]\ntitle: {a: 1}\n", "title must be a string"),
    ("methods: [promptfl]\nsetting: [1]\n", "setting is a mapping"),
])
def test_a_malformed_compare_spec_exits_2_naming_the_file(tmp_path, capsys, body, want):
    from raysim.tools.compare import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(body)
    assert main([str(spec), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys)
    assert want in line and (str(spec) in line or "methods" in line or "seeds" in line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


@pytest.mark.parametrize("base", ["5", "[1, 2]", "abc"])
def test_a_sweep_whose_base_is_no_mapping_exits_2_with_or_without_overrides(tmp_path, capsys, base):
    from raysim.tools.run import main

    f = tmp_path / "sweep.yaml"
    f.write_text(f"base: {base}\nspace: {{train.seed: {{grid: [1]}}}}\n")
    for extra in ([], ["train.rounds=2"]):
        assert main(["--sweep", str(f), *extra]) == 2
        line = one_line(capsys)
        assert "base: must be a mapping" in line


def test_a_sweep_key_of_more_than_10000_values_is_refused_before_any_is_checked(tmp_path, capsys):
    from raysim.tools.run import main

    f = tmp_path / "sweep.yaml"
    f.write_text("space: {train.seed: {grid: [" + ", ".join(map(str, range(20_000))) + "]}}\n")
    t0 = time.perf_counter()
    assert main(["--sweep", str(f)]) == 2
    assert "20,000 values" in one_line(capsys) and time.perf_counter() - t0 < 20  # the YAML read is most of it


@pytest.mark.parametrize("size", ["20000", "15", "513"])
def test_export_pfllib_refuses_an_image_size_out_of_range(tmp_path, capsys, size):
    from raysim.tools.export_pfllib import main

    assert main([str(tmp_path / "out"), "--image-size", size, "data.dataset=digits"]) == 2
    line = one_line(capsys)
    assert "--image-size must be between 16" in line and "512" in line and size in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [b"garbage\n", b"", b"PK\x03\x04junk", b"\x80\x02]q\x00."])
def test_a_garbage_pretrained_file_exits_2_naming_it(tmp_path, capsys, content):
    from raysim.tools.run import main

    f = tmp_path / "weights.pt"
    f.write_bytes(content)
    out = tmp_path / "run"
    rc = main([f"model.pretrained={f}", "model.name=raysim-tiny", "execution.backend=inline", "train.rounds=1",
               "train.num_clients=2", "data.shots=2", f"output.out_dir={out}", "output.progress=false",
               "output.tensorboard=false"])
    line = one_line(capsys)
    assert rc == 2 and f"model.pretrained='{f}'" in line and "cannot be loaded as raysim-tiny weights" in line
    assert not out.exists()


def test_a_damaged_pretrain_folder_exits_2_naming_it(tmp_path):
    from raysim.errors import DataError
    from raysim.models.clip import ModelSpec, load_clip

    folder = tmp_path / "pre"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"")
    for meta in ('{"model_name": ', '{"model_name": "../../etc/x"}', '{"model_name": 5}', "[]"):
        (folder / "raysim_pretrain.json").write_text(meta)
        with pytest.raises(DataError, match="raysim_pretrain.json and model config cannot be read"):
            load_clip(ModelSpec(model="raysim-tiny", pretrained=str(folder)))


# -- 7: an unreachable cluster ------------------------------------------------------------------------------

def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed at once: nothing listens there


def test_an_address_where_nothing_listens_is_refused_quickly_naming_it(monkeypatch):
    import ray

    from raysim.engine import cluster

    port = _free_loopback_port()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def never(**kwargs):
        raise AssertionError("ray.init must not be tried on an address that does not answer")

    monkeypatch.setattr(ray, "init", never)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"^execution.address='127.0.0.1:{port}': no Ray cluster answers at "
                                          rf"127.0.0.1:{port} within 5 s \(Connection refused\)"):
        cluster.init_ray(f"127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 3
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS='127.0.0.1:{port}': no Ray cluster answers"):
        cluster.init_ray("")


def test_a_loopback_head_that_never_accepts_times_out_naming_it():
    """A listening socket whose accept queue is full drops further SYNs: the connect waits, as for an
    unroutable host; the probe gives up after its timeout (loopback only: no packet leaves the machine)."""
    from raysim.engine.cluster import probe_head

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):  # fill the accept queue (its length is backlog + 1 on Linux)
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        time.sleep(0.2)
        t0 = time.perf_counter()
        with pytest.raises(ConfigError, match=rf"127.0.0.1:{port} within 0.5 s \(no answer\)"):
            probe_head(f"127.0.0.1:{port}", timeout=0.5)
        assert 0.4 < time.perf_counter() - t0 < 3
    finally:
        for c in fillers:
            c.close()
        server.close()


@FAST
@given(st.text(max_size=30))
def test_any_address_is_a_head_none_or_one_config_error(address):
    from raysim.engine.cluster import head_endpoint

    try:
        endpoint = head_endpoint(address)
    except ConfigError as e:
        assert str(e).startswith("execution.address=") and len(str(e)) < 200
        return
    assert endpoint is None or (endpoint[0] and 0 < endpoint[1] < 65536)


# -- 8: compare: the size of the plan, labels, --rounds --------------------------------------------------

def test_a_million_seeds_are_refused_before_anything_is_planned(tmp_path, capsys):
    from raysim.tools.compare import main

    t0 = time.perf_counter()
    assert main(["--methods", "promptfl", "--seeds", ",".join(map(str, range(10 ** 6))), "--dry-run", "--out",
                 str(tmp_path / "o")]) == 2
    assert "1,000,000 items" in one_line(capsys) and time.perf_counter() - t0 < 5
    assert main(["--methods", "promptfl,fedavg", "--grid", "data.beta=" + ",".join(str(i + 1) for i in range(100)),
                 "--seeds", ",".join(map(str, range(51))), "--dry-run"]) == 2
    line = one_line(capsys)
    assert "2 entries x 100 data.beta x 51 seeds make 10,200 runs" in line and "at most 10,000" in line
    assert list(tmp_path.iterdir()) == []


@FAST
@given(st.lists(st.integers(1, 400), max_size=4), st.integers(1, 30), st.integers(0, 40))
def test_the_run_count_is_refused_exactly_above_the_cap_without_expanding(dims, entries, seeds):
    import math

    from raysim.tools.compare import MAX_RUNS, CompareSpec, Entry, check_size

    spec = CompareSpec(methods=[Entry(label=f"m{i}", method="promptfl", overrides={}) for i in range(entries)],
                       grid={f"k{i}": list(range(n)) for i, n in enumerate(dims)}, seeds=list(range(seeds)))
    n = math.prod(dims) * entries * max(1, seeds)
    assert spec.size() == n
    if n > MAX_RUNS:
        with pytest.raises(ConfigError, match=f"make {n:,} runs"):
            check_size(spec)
    else:
        check_size(spec)


@pytest.mark.parametrize("labels, want", [
    (["x y", "x_y"], "'x_y' and 'x y': both are the folder 'x_y'"),
    (["A:B", "A-B"], "both are the folder 'A-B'"),
    (["..", "promptfl"], "would name a folder outside --out"),
    ([".", "promptfl"], "would name a folder outside --out"),
    (["/etc/x", "promptfl"], "would name a folder outside --out"),
    (["~", "promptfl"], "names no folder"),
    (["", "promptfl"], "names no folder"),
    (["/", "promptfl"], "names no folder"),
    (["same", "same"], "'same' twice"),
])
def test_labels_that_collide_or_leave_out_are_refused_naming_them(tmp_path, capsys, labels, want):
    from raysim.tools.compare import main

    spec = tmp_path / "spec.yaml"
    spec.write_text("methods:\n" + "".join(f"  - {{label: {json.dumps(lb)}, method: promptfl}}\n" for lb in labels))
    assert main([str(spec), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys)
    assert want in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_grid_values_that_sanitise_alike_are_refused_naming_both(tmp_path, capsys):
    from raysim.tools.compare import main

    assert main(["--methods", "promptfl", "--grid", "train.ctx_init=x y,x_y", "--dry-run", "--out", str(tmp_path / "o")]) == 2
    line = one_line(capsys)
    assert "'promptfl [ctx_init=x y]' and 'promptfl [ctx_init=x_y]' would both be written to" in line


@FAST
@given(st.lists(st.text(max_size=12), min_size=1, max_size=4))
def test_any_labels_are_refused_or_get_folders_of_their_own_inside_out(tmp_path, labels):
    from raysim.tools.compare import Entry, check_folders, check_labels, run_folder

    out = tmp_path / "out"
    entries = [Entry(label=lb, method="promptfl", overrides={}) for lb in labels]
    try:
        check_labels(entries)
    except ConfigError as e:
        assert str(e).startswith("compare: the label") and len(str(e)) < 400
        return
    folders = [run_folder(out, {}, e, None) for e in entries]
    check_folders(out, [({}, e, None) for e in entries], folders)
    assert len(set(folders)) == len(folders)
    assert all(out.resolve() in f.resolve().parents for f in folders)


def test_an_entry_s_own_train_rounds_wins_over_rounds(tmp_path):
    from raysim.tools.compare import plan, spec_from_args

    spec, _ = spec_from_args(["--methods", "promptfl:train.rounds=3,fedavg", "--rounds", "7", "model.name=raysim-tiny"])
    rounds = {entry.label: cfg.train.rounds for _, entry, _, cfg in plan(spec, tmp_path / "o")}
    assert rounds == {"promptfl:train.rounds=3": 3, "fedavg": 7}
    assert "an entry with its own train.rounds keeps it under --rounds" in " ".join(
        __import__("raysim.tools.compare", fromlist=["x"]).__doc__.split())


def test_ctrl_c_in_compare_is_one_line_naming_the_out_to_resume_with_exit_130(tmp_path, capsys, monkeypatch):
    import raysim.engine.loop as loop
    from raysim.tools.compare import main

    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run", interrupted)
    out = tmp_path / "cmp"
    assert main(["--methods", "promptfl", "--max-concurrent", "1", "--out", str(out), "model.name=raysim-tiny",
                 "execution.backend=inline"]) == 130
    line = one_line(capsys)
    assert line.startswith("interrupted:") and f"--out {out} to resume" in line


# -- 10: options between key=value; export-pfllib on a full disk -----------------------------------------

def test_key_value_before_an_option_is_accepted(tmp_path, capsys):
    from raysim.tools.run import build_parser, main

    a = build_parser().parse_intermixed_args(["train.rounds=1", "--config", "c.yaml", "dp.epsilon=1"])
    assert a.config == "c.yaml" and a.overrides == ["train.rounds=1", "dp.epsilon=1"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nosuchkey: 1\n")
    assert main(["train.rounds=1", "--config", str(cfg)]) == 2  # past argparse: the file's own key is refused
    assert "unknown config key 'nosuchkey'" in one_line(capsys)


EXPORT = ["--image-size", "16", "data.dataset=digits", "data.shots=2", "train.num_clients=2", "model.name=raysim-tiny",
          "model.pretrained="]


def test_export_pfllib_on_a_full_disk_leaves_nothing_and_runs_again(tmp_path, capsys, monkeypatch):
    import numpy as np

    from raysim.tools.export_pfllib import main

    out = tmp_path / "exported"
    real, calls = np.savez_compressed, []

    def full_at_the_third_archive(f, **kw):
        calls.append(1)
        if len(calls) == 3:
            f.write(b"PK\x03\x04 half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(f, "name", "?"))
        return real(f, **kw)

    monkeypatch.setattr(np, "savez_compressed", full_at_the_third_archive)
    assert main([str(out), *EXPORT]) == 2  # OUT first, then an option, then key=value
    line = one_line(capsys)
    assert "No space left on device" in line and "free some space, then run the command again" in line
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its temporary sibling
    monkeypatch.setattr(np, "savez_compressed", real)
    assert main([str(out), *EXPORT]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    assert sorted(p.name for p in (out / "train").iterdir()) == ["0.npz", "1.npz"]
    assert json.loads((out / "config.json").read_text())["raysim"]["image_size"] == 16


# -- 11: a full disk at the first write; rows past the last completed round ------------------------------

RUN = ["execution.backend=inline", "model.name=raysim-tiny", "model.pretrained=", "train.num_clients=2", "train.rounds=1",
       "data.shots=2", "output.progress=false"]


def test_a_full_disk_at_the_first_write_is_one_line_and_no_resume_hint(tmp_path, capsys, monkeypatch):
    from raysim.tools.run import main

    out = tmp_path / "run"
    real = Path.write_text

    def full(self, *a, **kw):
        if str(self).startswith(str(out)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    assert main([*RUN, f"output.out_dir={out}", "output.tensorboard=false"]) == 2
    line = one_line(capsys)
    assert "No space left on device" in line and "then run the command again" in line and "output.resume" not in line
    assert not out.exists()


def test_a_full_disk_in_tensorboard_s_writer_thread_prints_no_thread_traceback(tmp_path, capsys, monkeypatch):
    from tensorboard.summary.writer import record_writer

    from raysim.tools.run import main

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    out = tmp_path / "run"
    assert main([*RUN, f"output.out_dir={out}", "output.tensorboard=true"]) == 2
    line = one_line(capsys)  # no "Exception in thread", no Traceback: only the run's own line
    assert "No space left on device" in line and "then run the command again" in line
    assert not out.exists()


def test_results_rows_past_the_last_completed_round_are_ignored_with_a_warning_naming_the_file(tmp_path, caplog):
    from raysim.build import build_config
    from raysim.storage.runfolder import RunFolder

    run = tmp_path / "run"
    (run / "state").mkdir(parents=True)
    (run / "config.yaml").write_text(build_config({"method": "promptfl", "eval": {"last": 5}}).to_yaml())
    (run / "state" / "progress.json").write_text('{"completed_round": 1}')
    rows = ["round,in_client,cross_client,hm"] + [f"{r},{0.1 * r},{0.1 * r},{0.1 * r}" for r in range(5)]
    (run / "results.csv").write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="raysim.storage.runfolder"):
        df = RunFolder(run).results()
        utility = RunFolder(run).utility()
    assert df["round"].tolist() == [0, 1]
    assert utility["in_client"] == pytest.approx(0.05, abs=1e-9)  # the mean of rounds 0 and 1 only (0.0, 0.1)
    warned = [r.getMessage() for r in caplog.records if "past the last completed round" in r.getMessage()]
    assert warned and str(run / "results.csv") in warned[0] and "round(s) 2, 3, 4" in warned[0]


@pytest.mark.parametrize("text, want", [
    ('{"image_size": ' + "9" * 5000 + "}", "cannot be read as JSON"),
    ("[" * 100_000 + "]" * 100_000, "cannot be read as JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"image_size": "abc"}', "image_size must be an integer"),
    ('{"image_size": 10000000}', "image_size must be an integer in [1, 4096]"),
])
def test_a_hostile_backbone_config_json_is_one_config_error(tmp_path, text, want):
    """A VPDR backbone folder's config.json (a transformers ViT): 5,000 digits, 100,000 levels deep, the wrong
    shape or value, each a ConfigError naming the file; a file over 1 MiB is refused before it is read."""
    from raysim.models.vit_adapter import backbone_image_size

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(want)) as e:
        backbone_image_size(str(tmp_path))
    assert "config.json" in str(e.value) and len(str(e.value)) < 400
    (tmp_path / "config.json").write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="more than the 1048576 bytes"):
        backbone_image_size(str(tmp_path))


def test_garbage_resnet_weights_are_one_config_error(tmp_path):
    from raysim.models.vit_adapter import TorchvisionResNet

    f = tmp_path / "w.pth"
    f.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"resnet18 weights '.*w.pth' cannot be loaded \(UnpicklingError"):
        TorchvisionResNet("resnet18", str(f), image_size=32)


SPEC_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10 ** 30), st.floats(allow_nan=True),
                                     st.text("abz.:=;, _-", max_size=8)),
                           lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text("abz.", max_size=4), c,
                                                                                         max_size=3)), max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["title", "layout", "rounds", "methods", "grid", "setting", "seeds"]), SPEC_VALUES,
                       max_size=4))
def test_any_compare_spec_is_read_or_refused_with_a_config_error(tmp_path, spec):
    """Whatever each spec key holds, reading the spec gives a CompareSpec or one ConfigError (never another
    exception, which the front door would print as a traceback)."""
    from raysim.tools.compare import spec_from_args

    f = tmp_path / "spec.yaml"
    f.write_text(json.dumps({"methods": ["promptfl"], **spec}, allow_nan=True).replace("NaN", ".nan")
                 .replace("-Infinity", "-.inf").replace("Infinity", ".inf"))
    try:
        spec_from_args([str(f)])
    except ConfigError as e:
        assert len(str(e)) < 1500


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["name", "storage", "base", "space", "num_samples", "metric", "mode", "asha",
                                        "max_concurrent", "restore"]), SPEC_VALUES, max_size=4),
       st.sampled_from([[], ["train.rounds=2"], ["name=x"]]))
def test_any_sweep_file_is_read_or_refused_with_a_config_error(tmp_path, spec, overrides):
    from raysim.tools.sweep import load_sweep, validate_sweep

    f = tmp_path / "sweep.yaml"
    f.write_text(json.dumps({"space": {"train.seed": {"grid": [1]}}, **spec}, allow_nan=True).replace("NaN", ".nan")
                 .replace("-Infinity", "-.inf").replace("Infinity", ".inf"))
    try:
        validate_sweep(load_sweep(f, overrides))
    except ConfigError as e:
        assert len(str(e)) < 1500


def test_ctrl_c_in_export_pfllib_leaves_nothing_and_exits_130(tmp_path, capsys, monkeypatch):
    import raysim.data.pfllib_folder as pf
    from raysim.tools.export_pfllib import main

    def interrupted(root, *a, **kw):
        (Path(root) / "train").mkdir(parents=True)
        (Path(root) / "train" / "0.npz").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pf, "write_folder", interrupted)
    out = tmp_path / "exported"
    assert main([str(out), *EXPORT]) == 130
    assert one_line(capsys) == f"interrupted: nothing was written to {out}; run the command again"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_names_output_resume_only_for_a_folder_that_holds_a_run(tmp_path, capsys, monkeypatch):
    import raysim.engine.loop as loop
    from raysim.tools.run import main

    out = tmp_path / "run"
    kept = {"yes": False}

    def interrupted(cfg, **kw):
        if kept["yes"]:
            out.mkdir()
            (out / "config.yaml").write_text(cfg.to_yaml())
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run", interrupted)
    assert main([*RUN, f"output.out_dir={out}"]) == 130
    assert one_line(capsys) == "interrupted: the run folder held no run yet, so nothing was kept; run the command again"
    kept["yes"] = True
    assert main([*RUN, f"output.out_dir={out}"]) == 130
    assert one_line(capsys) == f"interrupted: every completed round is saved; continue with output.resume={out}"
