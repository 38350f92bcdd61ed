"""The name scopes of a training step's phases, by which a profile is read (breakdown.py).

A tiny module of names alone, so that the step (step/training_step.py) imports it without the
profiler protobufs breakdown.py reads traces with:

    input        taking the batch and staging a later one (staging.py)
    compute      reading the variables; forward, loss and gradients on the towers
    aggregation  the gradient exchange (large gradients summed at home included) and the
                 averaging of non-trainable state
    apply        the optimizer updates
"""

INPUT, COMPUTE, AGGREGATION, APPLY = PHASES = ("input", "compute", "aggregation", "apply")
STEP_SCOPE = "mgloop_step"  # around each step's ops, phases included
