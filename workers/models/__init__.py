"""Built-in models: a tiny causal transformer with a character tokenizer, and local HF loading."""
