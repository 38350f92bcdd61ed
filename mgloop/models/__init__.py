"""Model zoo: plain Keras 3 models, looked up by `--model` name.

A builder takes `(input_shape, num_classes)` and returns an uncompiled Keras
model that outputs logits and uses only built-in Keras layers, so the exported
file loads with `keras.models.load_model` without mgloop installed.

    options.py, checks.py   the models part of the settings (`config.models`); its check
    builders.py     the table of models by name: `register`, `names`, `get`
    registry.py     the package's body, loaded on first use: the table, built-ins imported
    mlp.py, cnn.py, big_mlp.py   small MLP and CNN; the Keras multi-GPU blog post's big MLP
    resnet20.py, minigooglenet.py   CIFAR-10 networks (He et al. 2016; PyImageSearch 2017)
    transformer_lm.py  a small decoder-only Transformer over tokens

May import: ground modules and data/.
"""

from mgloop import lazy_package

# Everything but the settings part (mgloop.models.options, plain Python) is loaded on first
# use from registry.py.
__getattr__ = lazy_package.getattr_of(__name__, "mgloop.models.registry")
