"""`streaming_diloco`'s 2025 options beyond the numpy model (tests/test_streaming_diloco.py):
the E3M0 format by hand and its error bound (aggregation/local/outer_formats.py), the link
report's charge of an overlapped exchange (observe/link_report.py), training with tau and
eager updates between simulated nodes, and a run resumed in the middle of a flight
(aggregation/local/overlap.py).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.aggregation.kernels import bitpacking
from mgloop.aggregation.local import outer_formats
from mgloop.aggregation.traffic import Occasion, Traffic
from mgloop.observe import link_model, link_report
from tests import helpers
from tests.copies_by_hand import method_on_copies

F32 = np.float32
U = 2.0 ** -24  # float32 unit roundoff


def test_e3m0_codes_by_hand():
    """Against A = 1: the values 0, 2^-6 .. 1 and their signs; a midpoint rounds to the
    smaller magnitude, just above it to the larger; the 4-bit fields (k, sign in bit 3)
    two per byte, the first element in the low nibble."""
    above = float(np.nextafter(F32(0.75), F32(1)))
    values = [1.0, -1.0, 0.75, above, -0.3, 2.0 ** -7, 0.008, 0.0, -0.0, 0.02, 0.5]
    want = [1.0, -1.0, 0.5, 1.0, -0.25, 0.0, 2.0 ** -6, 0.0, 0.0, 2.0 ** -6, 0.5]
    fields = outer_formats.e3m0_codes(tf.constant(values, tf.float32), tf.constant(1.0))
    assert fields.numpy().tolist() == [7, 15, 6, 7, 13, 0, 1, 0, 0, 1, 6]
    got = outer_formats.e3m0_integers(fields).numpy() * 2.0 ** -6
    assert got.tolist() == want
    packed = bitpacking.pack_levels(fields, 4).numpy()
    assert len(packed) == 6 and packed[0] == 7 + 16 * 15 and packed[5] == 6
    # a scale that is no power of two: the midpoints are A c_j rounded once
    peak = F32(3.0)
    d = F32(3.0) * F32(0.375) * F32(1 + 2 ** -20)  # just above the midpoint of A/4 and A/2
    k = outer_formats.e3m0_codes(tf.constant([d, -d / 2]), tf.constant(peak)).numpy()
    assert k.tolist() == [6, 5 + 8]


def test_e3m0_mean_is_within_its_bound_of_the_exact_mean():
    """outer_format=e3m0 on 3 copies, one sync of one fragment: every element of the mean
    lies within (1/T) sum_c max(|d_c|/3, A/128) of the exact mean (outer_formats.py), up
    to float32's roundings (a few u of A), and is not the exact mean."""
    rng = np.random.default_rng(1)
    shapes = [(3, 4), (4,), (7,)]
    init = [rng.standard_normal(shape).astype(F32) for shape in shapes]
    moved = [[w + rng.standard_normal(w.shape).astype(F32) for w in init] for _ in range(3)]
    method, copies = method_on_copies(
        "streaming_diloco:period=1,fragments=1,outer_format=e3m0", 3, init, moved, step_fn=False)
    got = method.outer_gradients(copies, [0, 1, 2])
    deltas = [[(init[i] - m[i]).astype(np.float64) for i in range(3)] for m in moved]
    peak = max(np.abs(d).max() for per_copy in deltas for d in per_copy)
    worst = 0.0
    for i in range(3):
        exact = np.mean([per_copy[i] for per_copy in deltas], axis=0)
        bound = np.mean([np.maximum(np.abs(per_copy[i]) / 3, peak / 128)
                         for per_copy in deltas], axis=0)
        error = np.abs(got[0][i].numpy() - exact)
        assert np.all(error <= bound * (1 + 1e-6) + 8 * U * peak), i
        worst = max(worst, error.max())
        for copy in got[1:]:  # every copy forms the same bits
            np.testing.assert_array_equal(copy[i].numpy(), got[0][i].numpy())
    assert worst > peak / 1000


def test_overlapped_exchange_costs_what_exceeds_its_steps_of_compute():
    """A hand-made traffic over 8 steps: 100 bytes every step, and 10^5 bytes on the
    steps s = 1, 5 of an occasion that may overlap k = 2 steps; on a 1 Gbit/s, 50 us link
    with compute C the step with overlap is (1/8) sum_s max(C, X_every) + (2/8)
    max(0, X_o - 2 C), X the alpha-beta time of one message of each; the same occasion
    with k = 0 gives (1/8) sum_s max(C, X(s)) as before."""
    link = link_model.parse("1gbit,50us")
    x_every, x_sync = (50e-6 + n / link.bytes_per_second for n in (100, 100_000))
    x_both = 2 * 50e-6 + 100_100 / link.bytes_per_second
    for hidden in (0, 2):
        traffic = Traffic()
        traffic.record("A", "B", 100)
        with traffic.on(Occasion("fragment 0", lambda s: s % 4 == 1, hidden)):
            traffic.record("A", "B", 100_000)
        schedule = link_report.Schedule(traffic, 8)
        for compute in (1e-4, 1e-3):
            figures = link_report.report(schedule, [link], compute)["links"][link.tag]
            if hidden:
                want = (max(compute, x_every) + 2 / 8 * max(0.0, x_sync - 2 * compute))
            else:
                want = (6 * max(compute, x_every) + 2 * max(compute, x_both)) / 8
            assert figures["step_seconds_overlap"] == pytest.approx(want, rel=1e-12)
            assert figures["exchange_seconds"] == pytest.approx(
                (6 * x_every + 2 * x_both) / 8, rel=1e-12)
    assert x_sync - 2 * 1e-4 > 0 and x_sync - 2 * 1e-3 < 0  # charged, then hidden


SPECS = ["streaming_diloco:period=4,fragments=2,tau=1,outer_format=e3m0",
         "streaming_diloco:period=4,fragments=2,tau=3,alpha=0.25,outer_bits=4",
         "streaming_diloco:period=4,fragments=2,eager=true",
         "streaming_diloco:period=2,fragments=1,eager=true,outer_format=e3m0"]


@pytest.mark.parametrize("spec", SPECS)
def test_training_between_four_nodes_moves_and_stays_finite(spec, tmp_path):
    """4 simulated nodes of one tower each, 6 steps (every fragment sent and merged): the
    weights move, stay finite and differ between the nodes."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=4, aggregation=spec)
    trainer = helpers.build_trainer(config)
    start = helpers.copy_weights(trainer)[0]
    helpers.run_batches(trainer, helpers.batches(6))
    weights = helpers.copy_weights(trainer)
    assert all(np.isfinite(w).all() for copy in weights for w in copy)
    assert any(np.abs(w - w0).max() > 1e-3 for w, w0 in zip(weights[0], start))
    assert any(not np.array_equal(a, b) for a, b in zip(weights[0], weights[1]))


@pytest.mark.parametrize("spec", SPECS[:1] + SPECS[2:3])
def test_inside_a_node_the_copies_stay_equal(spec, tmp_path):
    """2 nodes of 2 towers: after every step the two towers of a node are equal bit for
    bit (a merge tau steps after the send, or an eager outer step, is handed from the
    leader to the other tower on the step that changes the fragment)."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=2, optimizer="sgd",
                                  aggregation=spec)
    trainer = helpers.build_trainer(config)
    for s, batch in enumerate(helpers.batches(5)):
        helpers.run_batches(trainer, [batch])
        copies = helpers.copy_weights(trainer)
        for a, b in ((0, 1), (2, 3)):
            for x, y in zip(copies[a], copies[b]):
                np.testing.assert_array_equal(x, y, err_msg=f"step {s}")


def checkpoint_tensors(logdir):
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints"))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_dtype_map()
            if not key.startswith(("save_counter", "_CHECKPOINTABLE_OBJECT_GRAPH"))}


@pytest.mark.parametrize("spec", SPECS[:1] + SPECS[2:3])
def test_resume_in_the_middle_of_a_flight_is_bit_identical(spec, tmp_path):
    """period 4, 2 fragments, 2 towers: 6 steps straight equal 2 steps then a resumed run
    to 6 (fragment 0 is sent after step 1: with tau=1 its result is merged after step 2,
    after the restore; eager's r of fragment 0, made at step 1, is used at step 5), bit
    for bit under --deterministic: every tensor of the last checkpoint."""
    def run(name, steps):
        return mgloop.run(helpers.small_config(
            str(tmp_path / name), devices="cpu:2", aggregation=spec, train_steps=steps,
            steps_per_loop=2, checkpoint_every=0, eval_every=0))
    run("straight", 6)
    assert run("resumed", 2)["final_step"] == 2
    assert run("resumed", 6)["start_step"] == 2
    straight, resumed = (checkpoint_tensors(tmp_path / n) for n in ("straight", "resumed"))
    # x and m (and eager's r) of the mlp's 4 variables on each of the 2 copies are saved
    saved = sum(key.startswith("aggregation_state/streaming_diloco/") for key in straight)
    assert saved == (3 if "eager" in spec else 2) * 4 * 2
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
