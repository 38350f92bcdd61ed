"""The flags of `python -m mgloop.launch` and `python -m mgloop.sweep` are their options'
fields (cluster/launch_options.py, runs/sweep/options.py), made by the rules of
`mgloop.train`'s (runs/flags.py `define_flags_of`): no flag is defined by hand. Each entry
point's check (cluster/launch_checks.py, runs/sweep/checks.py) refuses a value out of range
in one line naming the flag, exit code 2, before anything is made. Fast: nothing is trained."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mgloop import settings
from mgloop.cluster import launch_checks
from mgloop.cluster.launch_options import LaunchOptions
from mgloop.errors import ConfigError
from mgloop.runs.sweep import checks as sweep_checks
from mgloop.runs.sweep.options import SweepOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a fresh process: each entry point's flags as absl holds them ({name: default}), and
# then train's flags defined beside them (the --plugin and --link both hold are shared).
PROBE = """
import json, sys
from absl import flags
from mgloop import launch, sweep
from mgloop.runs import flags as mgloop_flags
by_module = flags.FLAGS.flags_by_module_dict()
defined = {module: {flag.name: flag.default for flag in by_module[module]}
           for module in ("mgloop.launch", "mgloop.sweep")}
mgloop_flags.define_flags()
flags.FLAGS(["sweep", "--plugin=my.methods", "--output_dir=/tmp/never"])
options = mgloop_flags.options_from_flags(sweep.SweepOptions)
print(json.dumps({"defined": defined, "plugins": list(options.plugins),
                  "config_plugins": list(mgloop_flags.config_from_flags().plugins)}))
"""


@pytest.fixture(scope="module")
def probed():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fields(options_type) -> dict:
    return {settings.flag_name(field): list(field.default) if isinstance(field.default, tuple)
            else field.default for field in dataclasses.fields(options_type)}


@pytest.mark.parametrize("module, options_type", [("mgloop.launch", LaunchOptions),
                                                  ("mgloop.sweep", SweepOptions)])
def test_each_entry_points_flags_are_exactly_its_options_fields(probed, module, options_type):
    assert probed["defined"][module] == _fields(options_type)


def test_train_and_sweep_flags_share_plugin_in_one_process(probed):
    assert probed["plugins"] == probed["config_plugins"] == ["my.methods"]


@pytest.mark.parametrize("settings_, line", [
    (dict(num_workers=0), "--num_workers=0 is out of range: must be >= 1"),
    (dict(grace_seconds=-1.0), "--grace_seconds=-1.0 is out of range: must be >= 0"),
    (dict(stop_seconds=float("nan")), "--stop_seconds=nan is not a number: must be >= 0 "
                                      "seconds"),
    (dict(min_workers=2), "--min_workers applies only to an elastic job: add --elastic (a "
                          "failed worker then does not end the job), or drop --min_workers"),
])
def test_the_launch_check_refuses_in_one_line_naming_the_flag(settings_, line):
    given = tuple(settings_) if "min_workers" in settings_ else ()
    with pytest.raises(ConfigError) as refused:
        launch_checks.check(LaunchOptions(**settings_), given=given)
    assert str(refused.value) == line
    assert launch_checks.check(LaunchOptions()) == LaunchOptions()


@pytest.mark.parametrize("settings_, line", [
    (dict(seeds=0), "--seeds=0 is out of range: must be >= 1"),
    (dict(evals=0), "--evals=0 is out of range: must be >= 1"),
    (dict(tune_seeds=0), "--tune_seeds=0 is out of range: must be >= 1"),
    (dict(processes=0), "--processes=0 is out of range: must be >= 1"),
    (dict(tune_widen=-1), "--tune_widen=-1 is out of range: must be >= 0"),
    (dict(tune_passes=0), "--tune_passes=0 is out of range: must be >= 1"),
    (dict(cells_per_process=-1), "--cells_per_process=-1 is out of range: must be >= 0"),
    (dict(tune_search="random"), "--tune_search='random' is not one of: coordinate, grid"),
    (dict(stop_at_target=True), "--stop_at_target needs --target=METRIC>=VALUE"),
    (dict(output_dir=None), "--output_dir is not set; give the folder for the runs, records "
                            "and report"),
])
def test_the_sweep_check_refuses_in_one_line_naming_the_flag(settings_, line):
    with pytest.raises(ConfigError) as refused:
        sweep_checks.check(SweepOptions(**{"output_dir": "/tmp/never", **settings_}))
    assert str(refused.value) == line
    fine = SweepOptions(output_dir="/tmp/x")
    assert sweep_checks.check(fine) == fine


@pytest.mark.parametrize("command, line", [
    (["mgloop.launch", "--stop_seconds=-5"], "--stop_seconds=-5.0 is out of range: must be >= 0"),
    (["mgloop.sweep", "--tune_search=random", "--output_dir={out}"],
     "--tune_search='random' is not one of: coordinate, grid"),
])
def test_each_entry_point_refuses_a_value_out_of_range_in_one_line(command, line, tmp_path):
    out = tmp_path / "never"
    done = subprocess.run([sys.executable, "-m", *[word.format(out=out) for word in command]],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"{command[0]}: error: {line}"], done.stderr
    assert not os.listdir(tmp_path) and not done.stdout
