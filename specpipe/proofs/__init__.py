"""The proofs that specpipe is lossless: the local math (proof 1), the live swarm (proof 2) and
side-by-side generations (proof 3)."""
