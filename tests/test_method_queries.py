"""runs/ asks a method (its capabilities, aggregation/placement/queries.py), never probes it.

What a method can do is one `Capabilities` record (aggregation/capabilities.py): every
registered method has one, and `register` refuses a class without one or with the loose
class attributes that came before it (an old plugin's, silently ignored otherwise).

A probe by type or attribute (`isinstance(aggregation, NodeLevel)`, `getattr(aggregation,
"local", ...)`) ties runs/ to how a method is wrapped today and silently answers wrong for
a new wrapper; the method answers instead. The placement answers are checked where they
differ: a method between simulated nodes (with a node down) against one on the towers.
"""

import ast
import os

import pytest

from mgloop import aggregation
from mgloop.aggregation.dense.ring import Ring
from mgloop.aggregation.placement.between_nodes import NodeLevel
from tests import copies_by_hand, helpers

RUNS = os.path.join(os.path.dirname(aggregation.__file__), os.pardir, "runs")
AGGREGATION_CLASSES = {name for name in dir(aggregation.base) if isinstance(
    getattr(aggregation.base, name), type)} | {"NodeLevel", "CrossWorker", "Wrapper",
                                               "DeviceGroups"}


def probes(source: str) -> list[str]:
    """`isinstance(x, C)` with C a method class, and `getattr`/`hasattr` on an expression
    that names an aggregation, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            classes = ast.unparse(node.args[1])
            if any(name in classes for name in AGGREGATION_CLASSES):
                found.append(ast.unparse(node))
        if node.func.id in ("getattr", "hasattr") and node.args:
            if "aggregation" in ast.unparse(node.args[0]):
                found.append(ast.unparse(node))
    return found


def test_runs_never_probes_a_method_by_type_or_attribute():
    offending = {}
    for name in sorted(os.listdir(RUNS)):
        if name.endswith(".py"):
            with open(os.path.join(RUNS, name)) as handle:
                offending.update({f"runs/{name}: {p}": 1 for p in probes(handle.read())})
    assert not offending, f"runs/ probes a method; ask it instead: {sorted(offending)}"


def test_the_probe_finder_finds_probes():
    assert sorted(probes("x = trainer.aggregation.failures if isinstance(trainer.aggregation, "
                  "NodeLevel) else None\ny = getattr(aggregation, 'local', None)")) == [
        "getattr(aggregation, 'local', None)", "isinstance(trainer.aggregation, NodeLevel)"]


def test_placement_answers_between_nodes_and_on_towers(tmp_path):
    """The ring on 4 towers: one tower a node, no failures; DiLoCo between 2 simulated
    nodes of 2 towers with node 1 down at steps 2-3: 2 towers a node, the schedule."""
    towers = helpers.small_config(str(tmp_path / "ring"), devices="cpu:4")
    ring = helpers.build_trainer(towers).aggregation
    assert (ring.towers_per_node(), ring.failure_schedule(), ring.node_state_variables(),
            ring.exchanges_between_workers) == (1, None, None, False)
    config = helpers.small_config(str(tmp_path / "nodes"), devices="cpu:4", nodes=2,
                                  aggregation="diloco:period=2", node_failures="1@2-3",
                                  train_steps=4).validated()
    method, schedule = copies_by_hand.method_at_nodes(config)
    assert isinstance(method, NodeLevel)
    assert method.towers_per_node() == 2 and method.failure_schedule() is schedule
    assert schedule is not None and method.node_state_variables() is None  # one process
    assert not method.exchanges_between_workers  # no peers: the nodes are simulated


def test_every_registered_method_has_a_capabilities_record():
    for name in aggregation.names():
        assert isinstance(aggregation.get(name).capabilities, aggregation.Capabilities), name


def test_register_refuses_loose_capabilities_and_a_missing_record():
    class OldPlugin(aggregation.Aggregation):
        name = "test_old_plugin"
        layout, exact = aggregation.REPLICATED, False

    class OldRing(Ring):
        name = "test_old_ring"
        summable = False

    class NoRecord(aggregation.Aggregation):
        name = "test_no_record"

    refusals = {"OldPlugin": "declares exact, layout as class attributes",
                "OldRing": "declares summable as class attributes",
                "NoRecord": "has no capabilities record"}
    for cls in (OldPlugin, OldRing, NoRecord):
        with pytest.raises(TypeError) as refused:
            aggregation.register(cls)
        message = str(refused.value)
        assert "\n" not in message and f"{__name__}.test_register" in message, message
        assert refusals[cls.__name__] in message and "Capabilities(" in message, message
        assert cls.name not in aggregation.names()
    derived = Ring.capabilities.but(summable=False)  # the record's way
    assert (derived.summable, derived.layout, Ring.capabilities.summable) == (
        False, aggregation.REPLICATED, True)
