"""What a run trains with: the model's input and variables, losses, heads, metrics,
optimizers.

    options.py        the optimizer part of the settings (`config.optim`); checks.py its checks
    training_spec.py  a user's model_fn/loss/metrics/optimizer, checked and made whole
    model_input.py    the model's input shape against the data's, before any copy
    variables.py      the template's variables and their copies on devices
    losses.py, heads.py, perplexity.py   the built-in losses and what an output means
    metrics.py, accuracy.py              metric states summed over towers; accuracy by loss
    optim.py          the flag-driven optimizer, one per copy, and applying updates
    muon.py           --optimizer=muon: Keras's Muon, its AdamW part the same on every copy

May import: ground modules (errors, settings, phases). Below aggregation/, data/, step/:
nothing here knows how gradients travel.
"""
