"""Task module ppl."""
