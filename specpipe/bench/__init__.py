"""The benchmark drivers behind `specpipe bench`. The top floor beside the CLI: it may
import the store and the workers; nothing imports it."""
