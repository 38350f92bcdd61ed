"""Flags are made from the Config fields alone (name, default, type, help), and flagfiles work."""

import re
import subprocess
import sys

import pytest
from absl import flags

from mgloop.runs import config as config_lib
from mgloop import aggregation
from mgloop import data
from mgloop.runs import flags as mgloop_flags
from mgloop import settings
from mgloop.runs.config import Config

# The absl parser each resolved annotation must get (`X | None` as X).
PARSERS = {bool: flags.BooleanParser, int: flags.IntegerParser, float: flags.FloatParser,
           str: flags.ArgumentParser, int | None: flags.IntegerParser,
           str | None: flags.ArgumentParser, tuple[str, ...]: flags.ArgumentParser}


@pytest.fixture
def parsed():
    """Parses a command line into the flags; unparses them afterwards."""
    mgloop_flags.define_flags()
    yield lambda *argv: flags.FLAGS(["train", *argv])
    flags.FLAGS.unparse_flags()


def test_the_flags_are_the_config_fields_with_their_defaults_types_and_help():
    mgloop_flags.define_flags()
    fields = config_lib.setting_fields()
    defined = {flag.name for flag in flags.FLAGS.flags_by_module_dict()["mgloop.runs.flags"]}
    assert defined == {settings.flag_name(field) for field in fields}
    hints = config_lib.setting_types()
    for field in fields:
        flag = flags.FLAGS[settings.flag_name(field)]
        repeatable = hints[field.name] == tuple[str, ...]
        assert isinstance(flag, flags.MultiFlag) == repeatable, field.name
        assert flag.default == (list(field.default) if repeatable else field.default), field.name
        assert type(flag.parser) is PARSERS[hints[field.name]], field.name
        assert flag.help.startswith(mgloop_flags.help_of(field)), field.name
        assert "{" not in flag.help, field.name  # every {choices} filled in


def test_plugin_is_a_repeatable_flag_filling_plugins(parsed, tmp_path):
    flagfile = tmp_path / "plugins.flags"
    flagfile.write_text("--plugin=my_methods\n")
    parsed(f"--flagfile={flagfile}", "--plugin=more.methods")
    assert mgloop_flags.config_from_flags().plugins == ("my_methods", "more.methods")


def test_an_int_flag_refuses_a_float_string_with_absls_error(parsed):
    with pytest.raises(flags.IllegalFlagValueError, match=r"train_steps.*1\.5"):
        parsed("--train_steps=1.5")


def test_flagfile_and_command_line_make_a_config(parsed, tmp_path):
    flagfile = tmp_path / "ring.flags"
    flagfile.write_text("--devices=cpu:4\n--aggregation=ring\n--learning_rate=0.2\n"
                        "--deterministic\n")
    parsed(f"--flagfile={flagfile}", "--batch_size_per_tower=8")
    assert mgloop_flags.config_from_flags() == Config(
        devices="cpu:4", aggregation="ring", learning_rate=0.2, deterministic=True,
        batch_size_per_tower=8)


def _builtin_help(field) -> str:
    """The field's help as a fresh process shows it: choices from a registry (the methods,
    the datasets) without what plugins registered in this test process (tests/plugins)."""
    if field.name == "aggregation":
        builtin = [name for name in aggregation.names()
                   if aggregation.get(name).__module__.startswith("mgloop.")]
    elif field.name == "dataset":  # registered datasets have no loader
        builtin = [name for name in data.names() if data._source(name).load is not None]
    else:
        return mgloop_flags.help_of(field)
    return field.metadata["help"].format(choices=", ".join(builtin))


def test_helpfull_shows_every_settings_help():
    result = subprocess.run([sys.executable, "-m", "mgloop.train", "--helpfull"],
                            capture_output=True, text=True, timeout=300)
    text = re.sub(r"\s+", "", result.stdout)  # absl wraps the lines at word boundaries
    for field in config_lib.setting_fields():
        assert re.sub(r"\s+", "", _builtin_help(field)) in text, field.name
        assert re.search(rf"--(\[no\])?{settings.flag_name(field)}:", result.stdout), field.name
