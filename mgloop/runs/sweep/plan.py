"""A study's plan: the grid of cells (variants x seeds), each cell's Config, and its target.

    cells      every variant of the grid (grid.py: `--vary`, `--set`) run once per seed
               s in `seeds`; cell (variant, s) trains from --seed=s in its own logdir
               <output_dir>/runs/seed=<s>/<variant folder> (a TensorBoard HParams session,
               grouped with the variant's other seeds)
    budget     --epochs=E: train_steps = ceil(E N / B) (N the training examples of the
               cell's dataset, B its global batch), or --set=train_steps=S
    evals      --evals=K evaluations spread over the budget (eval_every = ceil(steps / K));
               the last step is a multiple of eval_every, so the final eval is on the curve
    target     --target=METRIC>=VALUE or METRIC<=VALUE (an eval metric the cell reports,
               `eval_metrics`: loss, accuracy, and perplexity for a language model): the
               first eval at which it holds is the cell's time to target, in steps, bytes
               and modelled seconds (record.py); with --stop_at_target the cell stops there
               (its curve ends there too). A metric some cell does not report (a typo, or
               perplexity of a classifier) is refused with the cell's Config, as is a cell
               that evaluates nothing (a --plugin dataset registered without eval data):
               the sweep compares eval metrics (target.py parses it)
    tuning     --tune=KEY=V1,V2,..., --tune_seeds=N, --tune_search, --tune_widen, --tune_passes
               (tune.py, search.py): each variant's tuning search on seeds 1000.. first
               (`tuning_cells`: logdir runs/seed=<s>/<folder of variant and point>,
               record results/tuning/<variant>/<point>/seed=<s>.json),
               then its final seeds at its chosen point (`cells(chosen)`), beside the
               other variants' tuning (runner.py)

Every cell's Config is validated before the first one runs (one line naming the cell and
what is wrong), so a bad grid is refused before anything is built or any folder made (the
cell's run makes its logdir).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import re

from mgloop.runs.sweep import grid
from mgloop.runs.sweep import tune as tune_lib
from mgloop.runs.sweep.target import Target

TUNING = "tuning"  # results/tuning/...: the tuning cells' records


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the study: a variant of the grid with one seed."""

    variant: grid.Variant
    seed: int
    point: tuple = ()  # ((key, value text), ...): the tuned settings (tune.py)
    tuning: bool = False  # a cell of the variant's tuning grid (else a final seed)

    @property
    def name(self) -> str:
        if self.tuning:
            return f"{self.variant.name} tuning {tune_lib.text_of(self.point)} seed={self.seed}"
        return f"{self.variant.name} seed={self.seed}"

    @property
    def folder(self) -> str:
        """<variant folder>/seed=<s>, relative to the sweep's runs/ and results/ (a tuning
        cell: tuning/<variant folder>/<point folder>/seed=<s>)."""
        if self.tuning:
            return os.path.join(TUNING, variant_folder(self.variant.name),
                                variant_folder(tune_lib.text_of(self.point)), f"seed={self.seed}")
        return os.path.join(variant_folder(self.variant.name), f"seed={self.seed}")

    @property
    def trial(self) -> str:
        """The TensorBoard trial (the logdir's last part): the variant, or the variant at
        a tuning point."""
        if self.tuning:
            return variant_folder(f"{self.variant.name} {tune_lib.text_of(self.point)}")
        return variant_folder(self.variant.name)


def variant_folder(name: str) -> str:
    """A folder name for a variant: its name with characters other than letters, digits,
    `.=-` made `_`, and 6 hex digits of its hash, so that two names never share one."""
    readable = re.sub(r"[^A-Za-z0-9.=-]+", "_", name)[:80]
    return f"{readable}-{hashlib.sha1(name.encode()).hexdigest()[:6]}"


@dataclasses.dataclass(frozen=True)
class Plan:
    vary: tuple[str, ...]
    set: tuple[str, ...]
    seeds: tuple[int, ...]
    output_dir: str
    epochs: float | None = None
    evals: int = 20
    target: Target | None = None
    stop_at_target: bool = False
    links: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    tune: tuple[str, ...] = ()  # --tune items (tune.py)
    tune_seeds: tuple[int, ...] = tune_lib.tuning_seeds(1)
    tune_search: str = "grid"  # --tune_search: grid or coordinate (tune.py)
    tune_widen: int = 0  # --tune_widen: values added past an edge, per axis and side
    tune_passes: int = 1  # --tune_passes: the coordinate search's passes over the axes

    def variants(self) -> list[grid.Variant]:
        """The grid's variants, checked (and the --tune axes against them)."""
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise grid.SpecError(f"--epochs={self.epochs}: give a finite number of epochs > 0")
        variants = grid.variants(list(self.vary), list(self.set))
        for variant in variants:
            if "seed" in variant.settings or "logdir" in variant.settings:
                raise grid.SpecError("--vary/--set seed or logdir: the sweep sets them "
                                     "(--seeds, --output_dir)")
        from mgloop.runs.sweep import search
        if self.tune_search not in search.SEARCHES:
            raise grid.SpecError(f"--tune_search={self.tune_search}: give one of "
                                 f"{', '.join(search.SEARCHES)}")
        if self.tune:
            if set(self.tune_seeds) & set(self.seeds):
                raise grid.SpecError(f"--seeds: the final seeds reach the tuning seeds "
                                     f"{self.tune_seeds[0]}..; give fewer than "
                                     f"{tune_lib.TUNING_SEED_BASE}")
            from mgloop import aggregation
            aggregation.load_plugins(self.plugins)  # a plugin method's options
            tune_lib.check(self._axes(), variants)
        return variants

    def _axes(self) -> list:
        return tune_lib.parse(self.tune, grid.field_types())

    def tune_points(self, variant: grid.Variant) -> list[tuple]:
        """The variant's tuning grid as given (tune.points: the cross product of the --tune
        values, every one checked before anything runs; the search runs all of it, or a
        line of it at a time, plus any widened values); [()] without --tune."""
        return tune_lib.points(self._axes(), variant) if self.tune else [()]

    def tuning_cells_of(self, variant: grid.Variant, point: tuple) -> list[Cell]:
        return [Cell(variant, seed, point, tuning=True) for seed in self.tune_seeds]

    def tuning_cells(self) -> list[Cell]:
        """Every variant's tuning grid on the tuning seeds: variants in grid order, points
        within each, seeds within each point; none for a variant that tunes nothing."""
        return [cell for variant in self.variants()
                for point in self.tune_points(variant) if point
                for cell in self.tuning_cells_of(variant, point)]

    def cells(self, chosen: dict | None = None) -> list[Cell]:
        """Every variant with every final seed: variants in grid order, seeds within each;
        each at its chosen point ({variant name: point}: search.chosen_point), if given."""
        chosen = chosen or {}
        return [Cell(variant, seed, chosen.get(variant.name, ()))
                for variant in self.variants() for seed in self.seeds]

    def logdir(self, cell: Cell) -> str:
        """runs/seed=<s>/<variant folder>: TensorBoard's HParams dashboard groups sessions
        by trial id, the logdir's last part (summaries.py), so a variant's seeds are one
        group (its metrics shown per seed and aggregated)."""
        return os.path.join(self.output_dir, "runs", f"seed={cell.seed}", cell.trial)

    def result_path(self, cell: Cell) -> str:
        return os.path.join(self.output_dir, "results", cell.folder + ".json")

    def config(self, cell: Cell):
        """The cell's Config, checked (`validated`; ConfigError naming the cell)."""
        from mgloop.runs.config import Config
        from mgloop.errors import ConfigError
        settings = {"plugins": self.plugins, "links": self.links,
                    **tune_lib.settings_of(cell.variant, cell.point, grid.field_types()),
                    "seed": cell.seed, "logdir": self.logdir(cell)}
        try:
            config = Config(**settings).validated(on_disk=False)
            if self.epochs is not None:
                steps = max(1, math.ceil(self.epochs * training_examples(config)
                                         / config.global_batch_size))
            elif "train_steps" in settings:
                steps = config.train_steps
            else:
                raise ConfigError("give the budget: --epochs=E or --set=train_steps=S")
            every = max(1, math.ceil(steps / self.evals))
            steps = every * math.ceil(steps / every)  # the last step evaluates
            final = Config(**{**settings, "train_steps": steps, "eval_every": every})
            final.validated(on_disk=False)  # no folder made; mgloop.run validates it again
            self._check_metrics(final)
            return final
        except ConfigError as error:
            raise ConfigError(f"cell {cell.name}: {error}") from None

    def _check_metrics(self, config) -> None:
        """The cell reports eval metrics, and the --target's among them (ConfigError)."""
        from mgloop.errors import ConfigError
        reported = eval_metrics(config)
        if not reported:
            raise ConfigError(f"--dataset={config.dataset} has no eval data, so the cell "
                              "reports no eval metric to compare; register the dataset with "
                              "eval= (docs/plugins.md)")
        if self.target is not None and self.target.metric not in reported:
            raise ConfigError(f"--target={self.target}: --model={config.model} on --dataset="
                              f"{config.dataset} reports no eval {self.target.metric}; give "
                              f"METRIC>=V or METRIC<=V of one it reports: {', '.join(reported)}")


def eval_metrics(config) -> tuple[str, ...]:
    """The eval metrics a cell's run reports (`eval/NAME` in its history and record). A
    cell is `mgloop.run(config)`: --model with mgloop's default loss and metrics
    (training_spec.resolve), so

        loss        always
        accuracy    the default cross-entropy defines one (metrics.default_metrics)
        perplexity  where --dataset gives sequences of tokens: the labels are next tokens,
                    so the model that trains on them outputs a sequence of token logits
                    (perplexity.for_sequences; a --plugin dataset's shapes are not known
                    before it is read, so it may report one too)

    and none where --dataset has no eval data (a --plugin dataset registered without eval)."""
    from mgloop import data
    from mgloop.runs import experiment
    from mgloop.training import metrics as metrics_lib
    from mgloop.training import perplexity
    if not data.has_eval_data(config.dataset):
        return ()
    names = ["loss"] + [m.name for m in metrics_lib.default_metrics(experiment.default_loss())]
    if data.streamed(config.dataset) or data.sequence_length_of(config.data) is not None:
        names.append(perplexity.Perplexity.name)
    return tuple(names)


@functools.cache
def _examples(dataset: str, data_dir, sequence_length) -> int:
    from mgloop import data
    return len(data.load(dataset, 0, data_dir, sequence_length).train_y)


def training_examples(config) -> int:
    """N: the training examples of a config's --dataset (its epochs' unit)."""
    from mgloop import data
    return _examples(config.dataset, config.data_dir, data.sequence_length_of(config.data))


def towers_needed(configs) -> int:
    """The most towers of any cell: the logical CPUs a process running them all makes."""
    from mgloop.cluster import devices
    return max(devices.parse(c.devices).num_towers for c in configs)
