"""What one does with a trained run: export it to Hugging Face, generate text, evaluate it."""
