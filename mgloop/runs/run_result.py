"""What `mgloop.run` gives back: the summary, the trained model, the history.

`RunResult` reads like the summary dict it holds (`result["final_train_loss"]`, as
summary.json), and adds

    model      the model the method produces (summary["evaluated_model"] says which;
               aggregation/base.py `global_model`): the template model (variable copy 0)
               for a method whose copies are equal; for one whose copies differ between
               its synchronisations, an evaluation copy holding the DiLoCo family's outer
               parameters x or local SGD's and SPARTA's mean of the nodes' copies, never
               one node's replica (runs/inference.py). The same model is evaluated,
               predicted with and exported. A plain Keras model: `model.predict(x)`,
               `model.evaluate(...)` after `model.compile(...)`, `model.save(...)` work
               in the same process. The checkpoint keeps copy 0 as its main weights (with
               every other copy and the method's state: a resume is exact)
    history    callbacks.History: the records {"step", "train/loss", "train/NAME", ...,
               and "eval/..." where it evaluated} of every eval and of the loops ending on
               --summary_every (else --log_every, else every loop); `history.of(name)`
    trainer    the Trainer (trainer.py), whose `evaluate(batches)` and `predict(x,
               batch_size)` run on the towers with the run's loss and metrics

A run that had nothing left to train (its checkpoint already at --train_steps) or was
stopped by a signal has its model restored from / saved to the checkpoint and an empty
history.
"""

from __future__ import annotations

from collections.abc import Mapping

from mgloop.runs import callbacks as callbacks_lib


class RunResult(Mapping):
    def __init__(self, summary: dict, trainer=None, history: callbacks_lib.History | None = None):
        self.summary = summary
        self.trainer = trainer
        self.model = trainer.global_model() if trainer is not None else None
        self.history = history if history is not None else callbacks_lib.History()

    def __getitem__(self, key):
        return self.summary[key]

    def __iter__(self):
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)

    def __repr__(self) -> str:
        return (f"RunResult(final_step={self.summary.get('final_step')}, "
                f"eval_loss={self.summary.get('eval_loss')}, model={self.model!r})")

    def evaluate(self, batches) -> dict[str, float]:
        """The run's loss and metrics over a tf.data.Dataset of (x, y) batches, on the towers."""
        return self.trainer.evaluate(batches)

    def predict(self, inputs, batch_size: int | None = None):
        """Model outputs in inference mode, on the towers (inference.TowerInference.predict)."""
        return self.trainer.predict(inputs, batch_size)
