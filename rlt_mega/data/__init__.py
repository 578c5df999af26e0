"""Tokenizers, datasets (pretraining text, SFT pairs, prompts) and the arithmetic generator."""
