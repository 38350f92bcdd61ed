"""The Transformer LM on byte tokens of text files: windows, refusals, towers vs one device,
token accuracy equal to a numpy count and perplexity = exp(mean token loss)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mgloop import data
from mgloop.runs.config import Config
from mgloop.errors import ConfigError
from mgloop.models import transformer_lm
from tests import helpers, tolerance

LENGTH, BATCH, STEPS = 8, 8, 2
TEXT = "the quick brown fox jumps over the lazy dog; héllo wörld ✓ " * 12  # multi-byte UTF-8


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    (folder / "b.txt").write_text(TEXT[:200], encoding="utf-8")
    (folder / "sub").mkdir()
    (folder / "sub" / "a.txt").write_text(TEXT, encoding="utf-8")
    (folder / ".hidden").write_bytes(b"\xff\xfe not read")
    return str(folder)


@pytest.fixture(scope="module")
def dataset(text_dir):
    return data.load("text", 0, text_dir, LENGTH)


def test_sequences_are_the_files_bytes_and_their_next_bytes(dataset):
    stream = np.frombuffer(TEXT[:200].encode() + TEXT.encode(), np.uint8)  # b.txt < sub/a.txt
    count = (len(stream) - 1) // LENGTH
    x = np.concatenate([dataset.train_x, dataset.eval_x])
    y = np.concatenate([dataset.train_y, dataset.eval_y])
    assert x.shape == y.shape == (count, LENGTH) and x.dtype == np.int32
    assert len(dataset.eval_x) == max(1, count // 10)
    np.testing.assert_array_equal(x.reshape(-1), stream[:count * LENGTH])
    np.testing.assert_array_equal(y.reshape(-1), stream[1:count * LENGTH + 1])
    assert dataset.num_classes == 256 and dataset.input_shape == (LENGTH,)


def test_bad_text_settings_are_refused_in_one_line(tmp_path, text_dir):
    (tmp_path / "x.bin").write_bytes(b"ok\xff\xfe")
    with pytest.raises(ConfigError, match=r"x.bin is not UTF-8 text \(byte 2\)"):
        data.check("text", str(tmp_path))
    with pytest.raises(ConfigError, match="holds no files"):
        data.check("text", str(_empty(tmp_path)))
    with pytest.raises(ConfigError, match="fewer than the 2 needed"):
        data.load("text", 0, text_dir, 10_000)
    base = dict(logdir=str(tmp_path / "run"), devices="cpu:1")
    for settings, message in [
            (dict(sequence_length=8), "--dataset=synthetic has no sequences"),
            (dict(lm_layers=2), "only --model=transformer_lm reads it, not --model=mlp"),
            (dict(model="transformer_lm"), "--dataset=synthetic does not give; use --dataset"),
            (dict(model="transformer_lm", dataset="text", data_dir=text_dir, lm_width=30,
                  lm_heads=4), "--lm_width=30 does not split into --lm_heads=4"),
            (dict(model="transformer_lm", dataset="text", data_dir=text_dir, lm_layers=0),
             "--lm_layers=0 is out of range")]:
        with pytest.raises(ConfigError, match=message):
            Config(**base, **settings).validated()


def _empty(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def tiny_lm():
    return transformer_lm.transformer_lm((LENGTH,), 256, lm_layers=1, lm_width=16, lm_heads=2)


@pytest.fixture(scope="module")
def steps_batches(dataset):
    stream = dataset.train_batches(BATCH, seed=3).take(STEPS)
    return [(x.numpy(), y.numpy()) for x, y in stream]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, steps_batches):
    config = helpers.small_config(str(tmp_path_factory.mktemp("ref") / "run"),
                                  global_batch_size=BATCH)
    return helpers.train_reference_bounded(config, steps_batches, tiny_lm)


# ring on 4 towers: the token embedding's rows are all-gathered; ps_cpu on 2: sent home as rows
@pytest.mark.parametrize("towers,method", [(2, "ps_cpu"), (4, "ring")])
def test_lm_on_towers_equals_one_device(tmp_path, steps_batches, reference, dataset, towers,
                                        method):
    config = helpers.small_config(str(tmp_path / "run"), devices=f"cpu:{towers}",
                                  aggregation=method, global_batch_size=BATCH)
    trainer = helpers.build_trainer(config, tiny_lm, input_shape=(LENGTH,))
    loss_sum = helpers.run_batches(trainer, steps_batches)
    assert trainer.step.exchange.plan.kept == [0]  # the token embedding travelled as rows
    for copy in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(copy, loss_sum, reference)
    if towers == 4:
        check_token_metrics(trainer, dataset)


def check_token_metrics(trainer, dataset):
    """Token accuracy = a numpy count of correct next tokens; perplexity = exp(mean token
    cross-entropy), both over the eval split, from the trained template's numpy logits."""
    metrics = trainer.evaluate(dataset.eval_batches(BATCH))
    logits = trainer.model(dataset.eval_x).numpy().astype(np.float64)  # eager, one device
    labels = dataset.eval_y
    correct = int(np.sum(np.argmax(logits, -1) == labels))
    assert metrics["accuracy"] == correct / labels.size
    shifted = logits - logits.max(-1, keepdims=True)
    token_loss = (np.log(np.exp(shifted).sum(-1))
                  - np.take_along_axis(shifted, labels[..., None], -1)[..., 0])
    # float32 on the towers: each token's log-softmax over K = 256 logits and the sum over
    # the n tokens (and the forward pass, path_sums) within 2 gamma(n') of the mean |loss|
    bound = 2 * tolerance.gamma(tolerance.path_sums(trainer.model, labels.size)) * np.mean(
        np.abs(token_loss))
    assert abs(math.log(metrics["perplexity"]) - token_loss.mean()) <= bound
    assert abs(metrics["loss"] - token_loss.mean()) <= bound
