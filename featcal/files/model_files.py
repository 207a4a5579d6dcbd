"""The names of a ``save_pretrained`` model folder's files (no torch: read by listing commands too)."""

MODEL_CONFIG = "config.json"  # a model folder's transformers configuration
WEIGHTS = "model.safetensors"  # a model folder's weights, in one file
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded model folder's index of its weight files
