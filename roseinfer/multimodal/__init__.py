"""Media in prompts: images decoded under the operator's limits (media.py)."""
