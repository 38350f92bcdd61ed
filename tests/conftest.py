"""Test-process set-up: 4 logical CPU devices, configured once before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from mgloop import devices  # noqa: E402

MAX_TOWERS = 4
devices.configure_logical_cpus(MAX_TOWERS)


@pytest.fixture
def logdir(tmp_path):
    return str(tmp_path / "run")
