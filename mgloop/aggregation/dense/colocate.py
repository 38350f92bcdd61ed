"""`colocate`: the single-loss baseline of Keras `multi_gpu_model` / `make_parallel`.

Rebuilt for TF2 so that the ablation can compare it with the tower loop. One
shared copy of the variables on the host CPU (the merge device); the global
batch is sliced per device and each device runs the model on its slice, but
there is no per-tower loss or gradient: the outputs are concatenated on the
host, ONE loss is taken over the global batch,

    loss = mean over the global batch of loss_fn(y, concat_t(model(x_t)))

and ONE gradient call differentiates it. TensorFlow places each gradient op
beside its forward op and sums each variable's per-device contributions
wherever it chooses: nothing in mgloop averages anything. The update is
applied once, on the host. Mathematically the same gradient as the tower loop
(the mean over the global batch), so it equals the single-device run to float
tolerance; what differs is where the work and the copies happen. The step itself
is `single_loss_step.SingleLossStep`, a kind of step beside the tower step: this
class only declares the layout (one copy on the host) and `single_loss`.
"""

from __future__ import annotations

from mgloop.aggregation import register
from mgloop.aggregation.dense.parameter_server import ParameterServerCpu


@register
class Colocate(ParameterServerCpu):
    name = "colocate"
    capabilities = ParameterServerCpu.capabilities.but(
        exchanges=False, single_loss=True,
        across_workers=False,  # the single loss is over one process's towers
        runs_between_processes=False)
