"""hintflow: agent runtime that pushes KV-cache hints to a program-aware engine node."""
