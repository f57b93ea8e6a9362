"""The toy transformer as a proof target named `toy`: a byte tokenizer folded into its vocab.

Importing this module registers it, in the test process and in the Celery worker the tests
start (`tests.regression.celery_toy`).
"""

from __future__ import annotations

from specpipe.decoding.target import Target, register_target
from tests.swarm.toy_stage import ToyConfig, ToyStage

CONFIG = ToyConfig()
SPLIT = ((0, 2), (2, CONFIG.n_layers))


def prompt_ids(text: str, raw: bool = False) -> list[int]:
    """Bytes folded into the toy vocabulary; the "template" is a leading id 1."""
    return [1] + [b % CONFIG.vocab for b in text.encode()][:24]


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def toy_target() -> Target:
    """The toy model with its layers split as the tests' stage processes split them."""
    return Target(
        name="toy",
        n_layers=CONFIG.n_layers,
        prompt_ids=prompt_ids,
        decode=decode,
        quant="fp32",
        load_stages=lambda _n, **_options: [ToyStage(CONFIG, a, b) for a, b in SPLIT],
    )


register_target("toy", toy_target)
