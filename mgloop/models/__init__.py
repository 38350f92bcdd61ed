"""Model zoo: plain Keras 3 models, looked up by `--model` name.

A builder takes `(input_shape, num_classes)` and returns an uncompiled Keras
model that outputs logits and uses only built-in Keras layers, so the exported
file loads with `keras.models.load_model` without mgloop installed.

May import: ground modules and data/.
"""

from mgloop import lazy_package

# Everything but the settings part (mgloop.models.options, plain Python) is loaded on first
# use from registry.py.
__getattr__ = lazy_package.getattr_of(__name__, "mgloop.models.registry")
