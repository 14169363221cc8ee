"""The evidence lab."""
