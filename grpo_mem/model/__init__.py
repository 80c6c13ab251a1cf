"""Model glue: the prompt-once group forward and its attention hook. Knows transformers, not TRL."""
