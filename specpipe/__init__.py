"""specpipe: one language model split by layer range across hosts, with lossless speculative
sampling. This package is the engine: sampling, drafting, model shards, wire format, ring
protocol, proofs and the CLI. It knows nothing of Flask or SQL (only the CLI composes them)."""

__version__ = "0.1.0"
