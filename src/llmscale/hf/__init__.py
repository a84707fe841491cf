"""Hugging Face interchange: llmscale weights and shapes to and from `transformers` folders."""
