"""The prompts the on-ring proofs generate from."""

# Prompts for proof 2: input-grounded ones (the answer is mostly in the prompt, so the n-gram
# drafter has something to propose) and open-ended ones (high-entropy stops).
DEFAULT_PROMPTS = (
    "Repeat this sentence exactly, then say it once more: the quick brown fox jumps over the "
    "lazy dog near the river bank.",
    "Summarise in one sentence: The lighthouse keeper climbed the stairs every evening, lit "
    "the lamp, and watched the ships pass until dawn.",
    "Write a short poem about the sea at night.",
    "Tell me a story about a robot who learns to paint.",
)
# The prompt proof 3 generates from, greedy and sampled.
DEFAULT_GENERATION_PROMPT = "Write three sentences about why the sky is blue."
