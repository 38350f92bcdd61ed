"""Step-time breakdown: ops of a profiled step attributed to compute, aggregation and apply."""

import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from mgloop.observe import breakdown
from tests import helpers


def add_event(plane, line, name, start_ps, duration_ps, tf_op=None):
    metadata_id = len(plane.event_metadata) + 1
    plane.event_metadata[metadata_id].id = metadata_id
    plane.event_metadata[metadata_id].name = name
    event = line.events.add(metadata_id=metadata_id, offset_ps=start_ps,
                            duration_ps=duration_ps)
    if tf_op is not None:
        stat_id = next(i for i, m in plane.stat_metadata.items() if m.name == "tf_op")
        event.stats.add(metadata_id=stat_id, str_value=tf_op)


def test_phase_seconds_of_a_synthetic_trace():
    space = xplane_pb2.XSpace()
    host = space.planes.add(name="/host:CPU")
    one, two = host.lines.add(timestamp_ns=1000), host.lines.add(timestamp_ns=1000)
    add_event(host, one, "while/body/compute/tower_0/MatMul:MatMul", 0, 40)
    add_event(host, two, "while/body/compute/tower_1/MatMul:MatMul", 10, 40)  # overlaps: 0..50
    add_event(host, one, "ExecutorState::Process", 0, 500)  # runtime, not an op
    add_event(host, one, "while/body/aggregation/AddN:AddN", 45, 20)  # 45..65, overlaps compute
    add_event(host, one, "while/body/apply/sgd/Sub:Sub", 100, 10)
    add_event(host, two, "while/body/mgloop_step/add:AddV2", 200, 5)  # the step, no phase
    add_event(host, one, "prime/Stage:Stage", 900, 5)  # outside the step
    gpu = space.planes.add(name="/device:GPU:0")  # kernels name their op in a tf_op stat
    gpu.stat_metadata[1].id = 1
    gpu.stat_metadata[1].name = "tf_op"
    kernels = gpu.lines.add(timestamp_ns=1000)
    add_event(gpu, kernels, "volta_sgemm", 120, 30, tf_op="while/body/apply/sgd/Mul:Mul")
    seconds = breakdown.phase_seconds(space)
    ps = 1e-12
    assert seconds["compute"] == pytest.approx(50 * ps)
    assert seconds["aggregation"] == pytest.approx(20 * ps)
    assert seconds["apply"] == pytest.approx(40 * ps)  # 100..110 on the host, 120..150 on GPU
    assert seconds["step"] == pytest.approx(205 * ps)  # first op 0 .. last step op 205
    assert seconds["other"] == pytest.approx((205 - 65 - 10 - 30) * ps)


def test_phase_of_takes_the_innermost_phase_scope():
    assert breakdown.phase_of("while/body/_1/compute/tower_0/dense/MatMul") == "compute"
    assert breakdown.phase_of("aggregation/apply_ring/AddN") == "aggregation"
    assert breakdown.phase_of("while/body/_1/global_step/AssignAdd") is None
    assert breakdown.phase_of("gradient_tape/while/compute_1/dense_1/MatMul") == "compute"
    assert breakdown.phase_of("while/dense_1/apply_fn/MatMul") is None
    assert breakdown.phase_of("while/compute/tower_1/aggregation/add") == "aggregation"


@pytest.mark.parametrize("aggregation", ["ring", "independent"])
def test_a_profiled_step_is_broken_down(logdir, aggregation):
    trainer = helpers.build_trainer(helpers.small_config(logdir, devices="cpu:4",
                                                         aggregation=aggregation))
    steps = helpers.batches(2)
    helpers.run_batches(trainer, steps[:1])  # traced outside the profile
    seconds = breakdown.profile_phases(lambda: helpers.run_batches(trainer, steps[1:]))
    assert seconds["input"] > 0 and seconds["compute"] > 0 and seconds["apply"] > 0
    assert max(seconds[p] for p in breakdown.PHASES) <= seconds["step"]
    assert 0 <= seconds["other"] <= seconds["step"]
    if aggregation == "ring":
        assert seconds["aggregation"] > 0
    else:  # independent replicas exchange nothing
        assert seconds["aggregation"] == 0
    assert int(trainer.global_step.numpy()) == 2  # the profiled step trained


def test_a_failed_profiled_run_leaves_no_profiler_running(logdir):
    def fail():
        raise RuntimeError("inside the profiled step")
    with pytest.raises(RuntimeError, match="inside the profiled step"):
        breakdown.profile_phases(fail)
    tf.profiler.experimental.start(logdir)  # would fail if the first session were still on
    tf.profiler.experimental.stop()
