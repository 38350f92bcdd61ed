"""The launcher's own settings (mgloop/launch.py, cluster/elastic.py): the train flags read
as mgloop.train's absl reads them, elastic settings refused without --elastic, and what the
launcher says when it restarts below --min_workers. Fast: nothing is trained."""

import subprocess
import sys

import pytest

from mgloop.cluster import elastic
from mgloop.cluster import launch_checks
from mgloop.cluster.launch_options import LaunchOptions

OPTIONS = elastic.ElasticOptions(min_workers=1, max_restarts=3, rejoin_seconds=0.0,
                                 logdir="/tmp/run")


def _launch(*args, timeout=60):
    """The launcher's exit code and stderr for `args` (refused before any worker starts)."""
    done = subprocess.run([sys.executable, "-m", "mgloop.launch", *args],
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr


@pytest.mark.parametrize("train_flags", [
    ["--logdir=/tmp/a", "--model=mlp"],
    ["--model=mlp", "--logdir", "/tmp/a"],  # absl's space form
    ["-logdir", "/tmp/a"],  # absl takes one dash too
    ["--logdir=/tmp/old", "--logdir", "/tmp/a"],  # the last one wins, as in absl
])
def test_logdir_is_read_in_every_form_absl_accepts(train_flags):
    assert elastic.flag_value(train_flags, "logdir") == "/tmp/a"


def test_logdir_and_the_batch_are_read_inside_nested_flagfiles(tmp_path):
    inner = tmp_path / "inner.flags"
    inner.write_text("# a comment\n--logdir=/tmp/from_file\n--global_batch_size=12\n")
    outer = tmp_path / "outer.flags"
    outer.write_text(f"--flagfile={inner}\n--model=mlp\n")
    flags = ["--flagfile", str(outer), "--train_steps=3"]
    assert elastic.flag_value(flags, "logdir") == "/tmp/from_file"
    assert elastic.flag_value(flags, "global_batch_size") == "12"
    assert elastic.flag_value(flags + ["--logdir=/tmp/later"], "logdir") == "/tmp/later"
    assert elastic.flag_value(["--", "--logdir=/tmp/a"], "logdir") is None  # past --
    assert elastic.flag_value(["--logdir_other=/tmp/a"], "logdir") is None


def test_the_elastic_launcher_finds_logdir_given_with_a_space_or_in_a_flagfile(tmp_path):
    """Refused for the batch (13 splits over no 2 towers), which is checked after --logdir:
    so --logdir was found; today's launcher said it was missing."""
    flagfile = tmp_path / "run.flags"
    flagfile.write_text(f"--logdir={tmp_path / 'run'}\n")
    for train_flags in (["--logdir", str(tmp_path / "run")], [f"--flagfile={flagfile}"]):
        code, err = _launch("--elastic", "--num_workers=2", "--devices_per_worker=cpu:2", "--",
                            *train_flags, "--global_batch_size=13")
        assert code == 2 and "needs --logdir" not in err, err
        assert "--global_batch_size=13 does not split" in err, err
    code, err = _launch("--elastic", "--", f"--flagfile={tmp_path / 'missing.flags'}")
    assert code == 2 and "missing.flags" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flag", ["--min_workers=2", "--max_restarts=1", "--rejoin_seconds=5"])
def test_elastic_settings_without_elastic_are_refused_in_one_line(flag, tmp_path):
    code, err = _launch("--num_workers=2", flag, "--", f"--logdir={tmp_path}")
    name = flag[2:].split("=")[0]
    assert code == 2, err
    assert err.strip() == (f"mgloop.launch: error: --{name} applies only to an elastic job: "
                           f"add --elastic (a failed worker then does not end the job), or "
                           f"drop --{name}"), err
    assert launch_checks.check(LaunchOptions(elastic=True), given=(name,))  # with --elastic


def test_a_failure_below_min_workers_says_it_restarts_with_a_replacement():
    """--num_workers=2 --min_workers=2: today's launcher said "continuing with 1 worker(s)"
    and then started a replacement; it says what it does."""
    options = OPTIONS.__class__(**{**OPTIONS.__dict__, "min_workers": 2})
    live, waiting, line = elastic.after_failure(2, 0, options, restarts=1)
    assert (live, waiting) == (2, 0)
    assert line == ("restart 1 of 3: 1 worker(s) left, fewer than --min_workers=2: a "
                    "replacement starts at once; continuing with 2 worker(s) from the last "
                    "complete checkpoint")
    live, waiting, line = elastic.after_failure(3, 0, options, restarts=2)
    assert (live, waiting) == (2, 1)
    assert line == ("restart 2 of 3: continuing with 2 worker(s) from the last complete "
                    "checkpoint; the failed slot rejoins later")


class _Round:
    """A round's Workers stand-in for elastic.run: worker 1 fails in the first round."""

    def __init__(self, count, env, log):
        self.count, self.env = count, env
        log.append(self)
        self.processes = [type("P", (), {"returncode": 0, "pid": 0})() for _ in range(count)]
        if len(log) == 1:
            self.processes[1].returncode = -9

    def running(self):
        return []

    def first_failure(self):
        return next(((i, p.returncode) for i, p in enumerate(self.processes)
                     if p.returncode), None)

    def blame(self, index, code):
        return f"worker {index} was killed by signal SIGKILL"

    def finish(self):
        pass


def test_the_rounds_below_min_workers_and_what_each_worker_is_told(tmp_path):
    """elastic.run with rounds that end at once: one failure in 2 workers with
    --min_workers=2 is named (every worker ended between two polls), restarts with 2, and
    says nothing contradictory; each round's workers
    get the launcher's record of the rounds so far (elastic_summary.elastic_rounds reads it)."""
    import json
    options = elastic.ElasticOptions(min_workers=2, max_restarts=1, rejoin_seconds=0.0,
                                     logdir=str(tmp_path))
    log, said = [], []
    code = elastic.run(lambda count, env: _Round(count, env, log), 2, options, [], 1.0,
                       said.append, [None])
    assert code == 0 and [r.count for r in log] == [2, 2], said
    assert "worker 1 was killed by signal SIGKILL; the other workers had ended" in said, said
    assert not any("continuing with 1 worker" in line for line in said), said
    assert not any("starting a replacement" in line for line in said), said
    second = json.loads(log[1].env[elastic.ROUNDS_VARIABLE])
    assert second["rounds"] == [
        {"workers": 2, "from_step": 0, "restarts": 0,
         "ended": "failed: worker 1 was killed by signal SIGKILL"},
        {"workers": 2, "from_step": 0, "restarts": 1}]


def test_the_launchers_default_batch_is_the_configs(tmp_path):
    """With neither batch size among the train flags, the elastic launcher splits the global
    batch a run takes by default (mgloop/data/options.py), over 3 workers of 2 towers."""
    from mgloop.data import options as data_options  # imports no TensorFlow
    default = data_options.DEFAULT_GLOBAL_BATCH_SIZE
    assert default % 6  # the test's premise: it does not split over 3 x 2 towers
    code, err = _launch("--elastic", "--num_workers=3", "--devices_per_worker=cpu:2", "--",
                        f"--logdir={tmp_path}")
    assert code == 2 and f"--global_batch_size={default} does not split over 3" in err, err
