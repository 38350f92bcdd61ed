"""`Wrapper`: an aggregation around another method, presenting it on more towers.

NodeLevel (between_nodes.py: the method between nodes) and DeviceGroups (device_groups.py:
several towers per device) each make the step see every tower while the method under
study, `inner`, runs on fewer units. What does not change between them is here: the
wrapper is the inner method as declared (name, options, capabilities, one set of traffic
counts) and its state, error bounds, syncs and variable scope are the inner
method's, and so is the model it produces (`global_model`); a subclass says where the
copies live and how the towers' gradients reach it.
"""

from __future__ import annotations

from mgloop.aggregation.base import REPLICATED, Aggregation


class Wrapper(Aggregation):
    """`inner` presented on the towers of `devices` (a subclass implements `reduce` and,
    where it differs from the inner method's, `parameter_devices`)."""

    def __init__(self, inner: Aggregation, devices, cluster=None):
        self.options_type = inner.options_type
        super().__init__(devices, inner.options, inner.transport_dtype.name, cluster=cluster,
                         traffic=inner.traffic,  # one set of counts for both
                         step_counter=inner.step_counter)  # and one step, the inner's
        self.inner, self.name = inner, inner.name
        self.capabilities = inner.capabilities  # the method's, as declared (a subclass: .but)

    def parameter_devices(self):
        """Shared: the inner method's copy. Replicated: one copy per device of the towers
        (a device's towers read one: device_groups.py)."""
        if self.capabilities.layout == REPLICATED:
            return list(self.devices.copy_devices)
        return self.inner.parameter_devices()

    def variable_scope(self):
        return self.inner.variable_scope()

    def check_model(self, variables):
        self.inner.check_model(variables)

    def build(self, variables):
        self.inner.build(variables)

    @property
    def state_variables(self):
        return self.inner.state_variables

    def error_bound(self, options, num_towers):
        return self.inner.error_bound(options, self.inner.num_towers)

    def error_bound_for(self, options, num_towers, num_elements):
        return self.inner.error_bound_for(options, self.inner.num_towers, num_elements)

    def syncs(self):
        return self.inner.syncs()

    # ---- the node-level protocol of checkpoints and elastic resizes (node_checkpoint.py) ----
    def rejoined(self, copies) -> None:
        """The inner method's rule on the copies it holds (a subclass whose inner method holds
        fewer copies than the step sees hands its result on: NodeLevel)."""
        self.inner.rejoined(copies)

    # ---- the model the method produces (base.py `global_model`) ----
    def global_model(self, copies):
        """The inner method's model from the copies it holds (a subclass whose inner method
        holds fewer copies than the step sees hands it those: NodeLevel)."""
        return self.inner.global_model(copies)

    def global_model_name(self) -> str:
        return self.inner.global_model_name()

    def node_copies(self, copies):
        return self.inner.node_copies(copies)
