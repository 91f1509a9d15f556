"""Shipped training configs (``gspo_ascend.configs``); every YAML here is validated by a CPU test."""
