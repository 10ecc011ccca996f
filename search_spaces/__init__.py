"""Knob definitions, their engine-native forms, and per-engine search-space presets."""
