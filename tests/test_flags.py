"""Flags mirror Config one to one, and flagfiles work."""

import dataclasses

from absl import flags

from mgloop import flags as mgloop_flags
from mgloop.config import Config


def test_every_config_field_is_a_flag_with_the_same_default():
    mgloop_flags.define_flags()
    for field in dataclasses.fields(Config):
        default = flags.FLAGS[mgloop_flags.flag_name(field.name)].default
        if field.name == "plugins":  # --plugin, repeatable: a list
            default = tuple(default or ())
        assert default == field.default, field.name


def test_flagfile_and_command_line_make_a_config(tmp_path):
    mgloop_flags.define_flags()
    flagfile = tmp_path / "ring.flags"
    flagfile.write_text("--devices=cpu:4\n--aggregation=ring\n--learning_rate=0.2\n"
                        "--deterministic\n")
    try:
        flags.FLAGS(["train", f"--flagfile={flagfile}", "--batch_size_per_tower=8",
                     "--plugin=my_methods", "--plugin=more/methods.py"])
        config = mgloop_flags.config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()
    assert config == Config(devices="cpu:4", aggregation="ring", learning_rate=0.2,
                            deterministic=True, batch_size_per_tower=8,
                            plugins=("my_methods", "more/methods.py"))
