"""`--devices` parsing, logical CPU set-up, and the too-late error."""

import pytest

from mgloop.cluster import devices
from mgloop.errors import ConfigError


def test_cpu_spec_simulates_towers():
    request = devices.parse("cpu:3")
    assert (request.kind, request.num_towers, request.simulated) == ("cpu", 3, True)


def test_auto_without_gpu_is_two_simulated_towers(gpus):
    gpus(0)
    assert devices.parse("auto") == devices.DeviceRequest("cpu", (0, 1))


@pytest.mark.parametrize("spec", ["gpu", "gpu:0", "gpu:1,0"])
def test_gpu_request_without_gpu_never_falls_back(spec, gpus):
    gpus(0)
    with pytest.raises(ConfigError, match="no GPU is visible.*--devices=cpu:N"):
        devices.parse(spec)


def test_auto_takes_every_gpu(gpus):
    gpus(3)
    assert devices.parse("auto") == devices.DeviceRequest("gpu", (0, 1, 2))
    assert not devices.parse("gpu").simulated


def test_gpu_list_is_checked_against_visible_gpus(gpus):
    gpus(2)
    assert devices.parse("gpu:1,0").indices == (1, 0)
    with pytest.raises(ConfigError, match=r"^--devices=gpu:0,2: GPU 2 does not exist; list "
                                          r"GPUs among the visible 0..1, or give "
                                          r"--devices=gpu \(every visible GPU\)$"):
        devices.parse("gpu:0,2")
    with pytest.raises(ConfigError, match="listed twice"):
        devices.parse("gpu:1,1")


@pytest.mark.parametrize("spec", ["", "cpu", "cpu:-1", "gpu:", "gpu:a", "cpu:2,3", "tpu"])
def test_malformed_specs(spec):
    with pytest.raises(ConfigError, match="--devices"):
        devices.parse(spec)


def test_setup_names_distinct_tower_devices():
    device_set = devices.setup(devices.parse("cpu:4"))
    assert device_set.towers == tuple(f"/device:CPU:{i}" for i in range(4))
    assert device_set.simulated and device_set.host == "/device:CPU:0"


def test_smaller_counts_reuse_configured_devices():
    devices.configure_logical_cpus(2)  # conftest made 4: nothing to do, no error
    assert devices.setup(devices.parse("cpu:2")).num_towers == 2


def test_too_late_to_add_devices_says_how_to_fix_it():
    with pytest.raises(ConfigError, match=r"already started with 4 CPU device\(s\).*"
                                          r"configure_logical_cpus\(8\) before any"):
        devices.configure_logical_cpus(8)
