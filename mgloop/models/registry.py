"""The body of mgloop.models (its package module loads it on first use; see there): the
table of builders (builders.py), with every built-in model imported, so registered.
"""

from mgloop.models import big_mlp, cnn, minigooglenet, mlp, resnet20, transformer_lm
from mgloop.models.builders import (ModelBuilder, builder_of, check_data, check_model_sizes,
                                    get, names, register, resolved_settings)

BUILT_IN = (big_mlp, cnn, minigooglenet, mlp, resnet20, transformer_lm)  # registered on import

__all__ = ["ModelBuilder", "builder_of", "check_data", "check_model_sizes", "get", "names",
           "register", "resolved_settings", "BUILT_IN"]
