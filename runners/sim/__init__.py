"""The built-in discrete-event simulator of a continuous-batching serving engine."""
