"""The names of a ``save_pretrained`` model folder's files (no torch: read by listing commands too)."""

MODEL_CONFIG = "config.json"  # a model folder's transformers configuration
WEIGHTS = "model.safetensors"  # a model folder's weights, in one file
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded model folder's index of its weight files
# What a language model's or a T5's folder holds beside config.json and the weights: the base's tokenizer files
# (a Llama's tokenizer.model, a T5's sentencepiece spiece.model, added tokens) and generation config, which every
# merged and calibrated folder (and its release) carries when the base has them.
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "spiece.model",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
# The text files of a model folder that featcal or transformers read: each must be UTF-8 (the sentencepiece
# models are binary).
MODEL_TEXT_FILES = (
    MODEL_CONFIG,
    WEIGHTS_INDEX,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "vocab.json",
    "merges.txt",
    "featcal_recipe.json",
    "mergekit_config.yml",
)
