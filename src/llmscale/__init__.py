"""llmscale: train GPT-style decoder LLMs past the memory wall, and plan how to scale them."""

__version__ = "0.1.0"
