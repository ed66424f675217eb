"""The command lines."""
