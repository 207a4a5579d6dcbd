"""Decoder-only causal language models (Llama, Mistral, Qwen2, Qwen3, Gemma-2): the calibration's adapter."""
