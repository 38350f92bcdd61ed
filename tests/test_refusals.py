"""Refusals across the entry points, one row each: the command line of `python -m
mgloop.train`, `mgloop.sweep` or `mgloop.launch`, exit code 2, the one error line on stderr
(it must name the setting and what would run), and no logdir or output folder left behind.

Where each row runs, so that the table costs one TensorFlow start at most:
- launch: its own settings are refused before TensorFlow loads, so each row is the real
  command, a subprocess (~0.2 s);
- train: through `mgloop.train.main` in this process, its flags parsed from the row (as
  absl's app.run parses them; TensorFlow is already loaded here);
- sweep: sweep's flags share names with train's (--link, --plugin) in absl's one registry,
  so its rows run together in ONE helper process (`python -m tests.test_refusals`), each
  through absl's app.run of `mgloop.sweep.main` with its flags parser, as the command line runs it.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from mgloop import errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")  # absl log lines (INFO, ...)
OUT = "{out}"  # replaced by the row's own folder, which must not exist afterwards

# (argv, the regex of the one error line); every row exits with 2
TRAIN = {
    "batch not a number": (["--global_batch_size=many"],
                           r"^flag --global_batch_size=many: invalid literal for int\(\)"),
    "unknown flag": (["--no_such_flag=1"], r"^Unknown command line flag 'no_such_flag'"),
    "krum on 2 towers": (
        ["--devices=cpu:2", "--aggregation=krum"],
        r"--aggregation=krum:nnm=0,f=1 needs at least 5 towers \(2f \+ 3 = 5 for f=1\); "
        r"--devices gives 2 towers: use at least 5 towers$"),
    "krum on 3 towers": (
        ["--devices=cpu:3", "--aggregation=krum"],
        r"--devices gives 3 towers: use f <= 0 or at least 5 towers$"),
    "multikrum m": (
        ["--devices=cpu:4", "--aggregation=multikrum:f=0,m=5"],
        r"multikrum:nnm=0,f=0,m=5 needs at least 5 towers .*: use m <= 4 or at least 5 "
        r"towers$"),
    "bulyan": (["--devices=cpu:4", "--aggregation=bulyan"],
               r"bulyan:nnm=0,f=1 needs at least 7 towers \(4f \+ 3 = 7 for f=1\); .*: use "
               r"f <= 0 or at least 7 towers$"),
    "trimmed mean": (["--devices=cpu:4", "--aggregation=trimmed_mean:trim=2"],
                     r"\(2b \+ 1 = 5 for trim=2\); .*: use trim <= 1 or at least 5 towers$"),
    "median nnm": (["--devices=cpu:4", "--aggregation=median:nnm=2"],
                   r"median:nnm=2 needs at least 5 towers \(2 nnm \+ 1 = 5 for nnm=2\); .*: "
                   r"use nnm <= 1 or at least 5 towers$"),
    "geomedian nnm": (["--devices=cpu:2", "--aggregation=geomedian:nnm=1"],
                      r"use nnm <= 0 or at least 3 towers$"),
    "centered clipping nnm": (["--devices=cpu:4", "--aggregation=centered_clipping:nnm=2"],
                              r"use nnm <= 1 or at least 5 towers$"),
    "krum and nnm": (["--devices=cpu:4", "--aggregation=krum:nnm=2"],
                     r"use nnm <= 1 and f <= 0 or at least 5 towers$"),
    "krum between 4 nodes": (
        ["--devices=cpu:8", "--nodes=4", "--aggregation=krum"],
        r"--aggregation=krum:nnm=0,f=1 between nodes needs at least 5 nodes \(2f \+ 3 = 5 "
        r"for f=1\); --nodes=4 gives 4 nodes: use f <= 0, --nodes=8 or --method_at=towers "
        r"\(the method then sees the 8 towers\)$"),
    "bulyan between 4 nodes": (
        ["--devices=cpu:4", "--towers_per_device=2", "--nodes=4", "--aggregation=bulyan"],
        r"bulyan:nnm=0,f=1 between nodes needs at least 7 nodes .*; --nodes=4 gives 4 "
        r"nodes: use f <= 0, --nodes=8 or --method_at=towers"),
    "adasum between 3 nodes": (
        ["--devices=cpu:6", "--nodes=3", "--aggregation=adasum"],
        r"adasum between nodes needs a power-of-two count of nodes .*; --nodes=3 gives 3 "
        r"nodes: use --nodes=2$"),
    "unknown link tier": (["--link=inside:10gbit,5us"],
                          r"--link=inside:10gbit,5us: the tier 'inside' is not one of: "
                          r"within:, between:"),
    "more fragments than variables": (  # refused once the template is built: no copy, no logdir
        ["--devices=cpu:2", "--aggregation=streaming_diloco:period=16,fragments=7"],
        r"--aggregation=streaming_diloco:fragments=7 needs at least 7 trainable variables "
        r"\(a fragment holds whole variables\); the model has 6: use fragments <= 6$"),
    "fragments past the period": (
        ["--devices=cpu:2", "--aggregation=streaming_diloco:fragments=100"],
        r"streaming_diloco:period=16,fragments=100: fragments must be <= period"),
    "alie ddof": (["--devices=cpu:4", "--aggregation=median", "--byzantine_towers=1",
                   "--attack=alie:ddof=2"], r"ddof=2 is not 0 or 1; give ddof=0 .* or ddof=1"),
    "non-finite float": (["--learning_rate=nan"],
                         r"--learning_rate=nan is not a finite number; give a finite one$"),
    "option twice": (["--aggregation=ring:shards=2,shards=3"],
                     r"ring option shards is given twice; give each option once$"),
}

SWEEP = {
    "no output folder": ([], r"--output_dir is not set; give the folder"),
    "vary value of the wrong type": ([f"--output_dir={OUT}", "--vary=learning_rate=fast"],
                                     r"--vary learning_rate: 'fast' is not a float"),
    "set of no setting": ([f"--output_dir={OUT}", "--set=no_such_setting=1"],
                          r"no_such_setting.*one of: .*learning_rate"),
    "cell refused": ([f"--output_dir={OUT}", "--vary=aggregation=krum", "--set=devices=cpu:2",
                      "--set=train_steps=2", "--seeds=1"],
                     r"krum:nnm=0,f=1 needs at least 5 towers .*: use at least 5 towers$"),
    "unknown link tier": ([f"--output_dir={OUT}", "--link=inside:10gbit,5us",
                           "--set=train_steps=2", "--seeds=1"],
                          r"the tier 'inside' is not one of: within:, between:"),
    "no seeds": ([f"--output_dir={OUT}", "--seeds=0"], r"--seeds=0"),
}

LAUNCH = {
    "no workers": (["--num_workers=0"],
                   r"--num_workers=0 is out of range: must be >= 1$"),
    "negative grace": (["--grace_seconds=-1"], r"--grace_seconds=-1.0 is out of range: must "
                                               r"be >= 0$"),
    "workers not a number": (["--num_workers=x"], r"^flag --num_workers=x: invalid literal "
                                                   r"for int\(\)"),
    "devices after --": (["--", "--devices=cpu:2"], r"--devices is set per worker by the "
                                                    r"launcher: give --devices_per_worker="),
}


def error_line(stderr: str, entry: str) -> str:
    """The refusal's one line: every other line of stderr is a log line (absl's format)."""
    lines = [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)
             and not line.startswith("WARNING: All log messages before absl")]
    assert len(lines) == 1 and lines[0].startswith(f"mgloop.{entry}: error: "), stderr[-2000:]
    return lines[0][len(f"mgloop.{entry}: error: "):]


def with_folder(argv, folder):
    return [arg.replace(OUT, str(folder)) for arg in argv]


# --- train: its main, in this process ----------------------------------------------------------

@pytest.fixture
def train_main():
    from absl import flags
    from mgloop import train  # its flags, defined once per process
    parse = errors.flags_parser("mgloop.train")  # as `python -m mgloop.train` parses
    yield lambda argv: (flags.FLAGS.unparse_flags(), parse(["mgloop.train", *argv]),
                        train.main(["mgloop.train"]))
    flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("row", sorted(TRAIN))
def test_train_refusal(row, train_main, tmp_path, capsys):
    argv, pattern = TRAIN[row]
    logdir = tmp_path / "never" / "run"
    with pytest.raises(SystemExit) as exit:
        train_main([*argv, f"--logdir={logdir}", "--train_steps=2"])
    assert exit.value.code == 2
    assert re.search(pattern, error_line(capsys.readouterr().err, "train"))
    assert not (tmp_path / "never").exists()


# --- sweep: every row in one helper process ----------------------------------------------------

def run_sweep_rows(rows: list[list[str]]) -> list[tuple[int, str]]:
    """(exit code, what was printed to stderr) of `python -m mgloop.sweep ARGV` per row,
    all in this process: absl's app.run of mgloop.sweep.main, the flags reset in between."""
    import contextlib
    import io
    from absl import app, flags
    from mgloop import sweep
    results = []
    for argv in rows:
        flags.FLAGS.unparse_flags()
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            try:
                app.run(sweep.main, argv=["mgloop.sweep", *argv], flags_parser=sweep.parse_flags)
                code = 0
            except SystemExit as error:
                code = error.code
        results.append((code, printed.getvalue()))
    return results


@pytest.fixture(scope="module")
def sweep_results(tmp_path_factory):
    """Every sweep row's (exit code, stderr, output folder), from one helper process."""
    base = tmp_path_factory.mktemp("sweep")
    names = sorted(SWEEP)
    argvs = [with_folder(SWEEP[name][0], base / name.replace(" ", "_")) for name in names]
    done = subprocess.run([sys.executable, "-m", "tests.test_refusals", json.dumps(argvs)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (code, text, base / name.replace(" ", "_"))
            for name, (code, text) in zip(names, results)}


@pytest.mark.xdist_group("refusals_sweep")  # one helper process for every row
@pytest.mark.parametrize("row", sorted(SWEEP))
def test_sweep_refusal(row, sweep_results):
    code, stderr, folder = sweep_results[row]
    pattern = SWEEP[row][1]
    assert code == 2, stderr[-2000:]
    assert re.search(pattern, error_line(stderr, "sweep"))
    assert not folder.exists()


# --- launch: before TensorFlow, the real command ------------------------------------------------

@pytest.mark.parametrize("row", sorted(LAUNCH))
def test_launch_refusal(row, tmp_path):
    argv, pattern = LAUNCH[row]
    done = subprocess.run([sys.executable, "-m", "mgloop.launch", *argv], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1  # no usage text
    assert re.search(pattern, error_line(done.stderr, "launch"))
    assert not os.listdir(tmp_path) and "tensorflow" not in done.stderr.lower()


if __name__ == "__main__":  # the helper process of the sweep rows
    print(json.dumps(run_sweep_rows(json.loads(sys.argv[1]))))
