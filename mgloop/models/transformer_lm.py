"""`transformer_lm`: a small decoder-only Transformer over tokens (GPT-2's block, pre-norm).

For input tokens [B, L] (int) and a vocabulary of V (`num_classes`), width W and H heads:

    h_0 = E_tok[tokens] + E_pos[0 .. L-1]                      (two Embedding tables)
    per block:  a = h + MHA(LN(h), causal mask)                 (position i attends to <= i)
                h = a + Dense_W(relu(Dense_4W(LN(a))))
    logits = Dense_V(LN(h_last))                                [B, L, V]

Built only of Keras layers and ops (Embedding, MultiHeadAttention with
`use_causal_mask=True`, LayerNormalization, Dense), no dropout, so the exported
model loads with `keras.models.load_model` alone. The default cross-entropy on the
[B, L, V] logits and labels [B, L] is the next-token loss per token; its mean is over
every token (mgloop.data.text). The attention's projections have no biases (as in
PaLM and LLaMA): a key bias shifts every score of a query by the same amount, which the
softmax cancels, so its gradient is 0 and it would never train. The defaults (2 blocks,
width 64, 4 heads) run on a CPU.
"""

import keras

from mgloop.errors import ConfigError
from mgloop.models.builders import register
from mgloop.models.options import ModelOptions

DEFAULT_LAYERS, DEFAULT_WIDTH, DEFAULT_HEADS = 2, 64, 4


def check_sizes(options: ModelOptions) -> None:
    """--lm_width is a multiple of --lm_heads (each head gets width / heads). That the data
    are token sequences is the registry's check_data (sequences=True)."""
    width = options.lm_width or DEFAULT_WIDTH
    heads = options.lm_heads or DEFAULT_HEADS
    if width % heads:
        raise ConfigError(f"--lm_width={width} does not split into --lm_heads={heads} equal "
                          f"heads; use a multiple of {heads}")


@register("transformer_lm", settings=("lm_layers", "lm_width", "lm_heads"),
          check=check_sizes, sequences=True)
def transformer_lm(input_shape, num_classes, lm_layers=DEFAULT_LAYERS, lm_width=DEFAULT_WIDTH,
                   lm_heads=DEFAULT_HEADS):
    if len(input_shape) != 1:
        raise ConfigError(f"--model=transformer_lm takes sequences of tokens (examples of "
                          f"shape (L,)), not examples of shape {tuple(input_shape)}; use "
                          "--dataset=text")
    (length,) = input_shape
    tokens = keras.Input(shape=(length,), dtype="int32", name="tokens")
    positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1  # 0 .. L-1
    h = (keras.layers.Embedding(num_classes, lm_width, name="token_embedding")(tokens)
         + keras.layers.Embedding(length, lm_width, name="position_embedding")(positions))
    for block in range(lm_layers):
        normed = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{block}_ln1")(h)
        h = h + keras.layers.MultiHeadAttention(
            lm_heads, lm_width // lm_heads, use_bias=False, name=f"block{block}_attention")(
                normed, normed, use_causal_mask=True)
        normed = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{block}_ln2")(h)
        hidden = keras.layers.Dense(4 * lm_width, activation="relu",
                                    name=f"block{block}_mlp_in")(normed)
        h = h + keras.layers.Dense(lm_width, name=f"block{block}_mlp_out")(hidden)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(h)
    return keras.Model(tokens, keras.layers.Dense(num_classes, name="logits")(h),
                       name="transformer_lm")
